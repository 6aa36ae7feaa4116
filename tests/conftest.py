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


# Each module's wall time, written as the next module starts (and at the end): a run cut
# off at CI's time limit still shows where its time went.
_module = {"name": None, "start": 0.0, "config": None}


def _write_module_time() -> None:
    config = _module["config"]
    reporter = config.pluginmanager.get_plugin("terminalreporter") if config else None
    if _module["name"] is not None and reporter is not None:
        reporter.write(f"\n[module time] {_module['name']}: {time.monotonic() - _module['start']:.0f} s\n")


def pytest_configure(config):
    _module["config"] = config


def pytest_runtest_logstart(nodeid, location):
    name = nodeid.split("::")[0]
    if name != _module["name"]:
        _write_module_time()
        _module.update(name=name, start=time.monotonic())


def pytest_sessionfinish(session):
    _write_module_time()
