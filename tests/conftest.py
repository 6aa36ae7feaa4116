import json
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

FLEET_KEY = bytes(range(32)).hex().encode()  # a valid fleet key (64 hex characters)


@pytest.fixture
def key_file(tmp_path):
    """A fleet key file as an operator writes it (mode 600) holding FLEET_KEY."""
    path = tmp_path / "fleet.key"
    path.write_bytes(FLEET_KEY)
    path.chmod(0o600)
    return str(path)


# `make test` runs the modules on 2 workers (pytest-xdist, ``-n 2 --dist loadscope``):
# most of a fleet test's time one core waits on the other (a prefill forward, then a
# decode step), so a second module fills it. The scheduler below makes each module one
# work unit (its fleet fixture is module-scoped), except the modules that make network
# namespaces: their hosts' addresses are fixed (testing/emulated_hosts.py,
# netns_host.py), so they share one unit and never run side by side.
NETNS_MODULES = {"test_decode_links.py", "test_demo.py", "test_partition.py", "test_three_hosts.py"}
# Modules that bound how fast something went (a link's rate, a request that must not wait
# for another's): marked ``alone``, and `make test` runs them after the others, with no
# module beside them on the 2 cores.
ALONE_MODULES = {"test_emulated_link.py", "test_slow_consumer.py", "test_slow_scatter.py",
                 "test_transport_mooncake.py"}
# Each unit's seconds on a 2-core Xeon with AMX (CI of stop 54): the heaviest start first,
# so that no long module is left to run alone at the end. Order only, never asserted.
with open(os.path.join(os.path.dirname(__file__), "module_seconds.json")) as _f:
    UNIT_SECONDS = json.load(_f)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if os.path.basename(item.nodeid.split("::")[0]) in ALONE_MODULES:
            item.add_marker(pytest.mark.alone)


def work_unit(nodeid: str) -> str:
    name = os.path.basename(nodeid.split("::")[0])
    return "netns" if name in NETNS_MODULES else name


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (it answers first)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesHeaviestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

        def _assign_work_unit(self, node):
            heaviest = max(self.workqueue, key=lambda unit: UNIT_SECONDS.get(unit, 0))
            self.workqueue.move_to_end(heaviest, last=False)
            super()._assign_work_unit(node)

    return ModulesHeaviestFirst(config, log)


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: runs with no other test module beside it (`make test`)")
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
