import os
import sys
import time

# Tests import the in-place build of the package from the repository root.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The suite runs every engine on this one host: their addresses default to loopback here
# (an engine's own default is the host's routed address, addresses.py), and prefill
# engines started side by side take free side-channel ports (their default is 8999).
# Tests of the defaults themselves, and the emulated-hosts test, set their own.
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("KVOPS_SIDE_CHANNEL_PORT", "0")

import pytest  # noqa: E402

# how a tier's modules share 2 workers; the markers every module declares (tiers.py)
from module_scheduler import make_scheduler, module_name  # noqa: E402
from tiers import KINDS  # noqa: E402

FLEET_KEY = bytes(range(32)).hex().encode()  # a valid fleet key (64 hex characters)


@pytest.fixture
def key_file(tmp_path):
    """A fleet key file as an operator writes it (mode 600) holding FLEET_KEY."""
    path = tmp_path / "fleet.key"
    path.write_bytes(FLEET_KEY)
    path.chmod(0o600)
    return str(path)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects any
def pytest_collection_modifyitems(items):
    """Refuse a module that declares no kind (tests/tiers.py): every module belongs to
    a tier, so none escapes the gate's scheme unseen."""
    unmarked = sorted({module_name(item.nodeid) for item in items
                       if not {mark.name for mark in item.iter_markers()} & KINDS})
    if unmarked:
        raise pytest.UsageError(
            f"test modules without a kind marker: {', '.join(unmarked)}. Add "
            f"pytestmark = [pytest.mark.<kind>, ...] after the imports, the kind one of "
            f"{', '.join(sorted(KINDS))} (tests/tiers.py, docs/testing.md)")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (it answers first)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    return make_scheduler(config, log)


def pytest_configure(config):
    # each worker's servers take ports from its own part of the range (serving/ports.py):
    # two fleets starting at once never draw the same one
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        os.environ["KVOPS_PORT_PART"] = f"{worker.lstrip('gw')}/{os.environ['PYTEST_XDIST_WORKER_COUNT']}"
    _modules["config"] = config


# Each module's wall time (from its first test's start to its last test's end), written
# as it ends: a run cut off at CI's time limit still shows where its time went. Kept by
# the process that reports (xdist's controller, or pytest itself without workers).
_modules = {"config": None, "left": {}, "start": {}}


def _module_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _count_tests(nodeids) -> None:
    if not _modules["left"]:
        for nodeid in nodeids:
            name = _module_of(nodeid)
            _modules["left"][name] = _modules["left"].get(name, 0) + 1


def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput"):
        _count_tests(item.nodeid for item in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    _count_tests(ids)


def pytest_runtest_logstart(nodeid, location):
    _modules["start"].setdefault(_module_of(nodeid), time.monotonic())


def pytest_runtest_logfinish(nodeid, location):
    config, name = _modules["config"], _module_of(nodeid)
    if name not in _modules["left"] or hasattr(config, "workerinput"):
        return
    _modules["left"][name] -= 1
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if _modules["left"][name] == 0 and reporter is not None:
        seconds = time.monotonic() - _modules["start"][name]
        reporter.write(f"\n[module time] {name}: {seconds:.0f} s\n")
