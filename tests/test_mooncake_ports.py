"""A new Mooncake engine never takes a handshake port an engine of this host drew
lately (transports/mooncake/ports.py): a producer keeps the earlier holder's segment
under that address and could not write to the new one.

Real Mooncake engines: a quarter of Mooncake's port range (512 ports, what the file
holds when full) is marked recent in a private file, and every engine started must come
out in the rest. The negative control starts engines with the check switched off and
sees some land in three quarters of the range. Neither fails by chance: an engine of the
first test lands on a marked port only after ``MAX_PORT_DRAWS`` (8) marked draws in a
row, 1 in 54,000, so 12 engines fail 1 run in 4,500; the control, 1 run in 4**12.
Marking half, as this test first did, failed 1 run in 21 (seen in CI: 8 marked draws in
a row).
"""
from __future__ import annotations

import logging
import os

import pytest

from torch_kvops.transports.mooncake.engine import load_engine_class, start_engine
from torch_kvops.transports.mooncake.ports import CAPACITY, RecentPorts

pytestmark = [pytest.mark.process]

MOONCAKE_PORTS = range(15000, 17000)  # where Mooncake draws its handshake port (seen)
MARKED = range(15000, 15000 + CAPACITY)  # a quarter: the file at its capacity
MARKED_FOR_CONTROL = range(15000, 16500)  # three quarters
ENGINES = 12


def marked_file(tmp_path) -> RecentPorts:
    recent = RecentPorts(str(tmp_path / "ports"), capacity=len(MOONCAKE_PORTS))
    with open(recent.path, "w") as f:
        f.writelines(f"127.0.0.1:{port}\n" for port in MARKED)
    return recent


class NoCheck(RecentPorts):
    """The check switched off: every port is taken as new."""

    def claim(self, address: str) -> bool:
        return True


def start_ports(recent: RecentPorts) -> list:
    engine_cls = load_engine_class()
    engines, ports = [], []
    for _ in range(ENGINES):
        engine, port = start_engine(engine_cls, "127.0.0.1", "tcp", "", quiet_log=True,
                                    recent_ports=recent)
        engines.append(engine)  # alive until the end: each draw is a fresh port
        ports.append(port)
    del engines
    return ports


def test_claims_remember_the_last_capacity_addresses(tmp_path):
    recent = RecentPorts(str(tmp_path / "sub" / "ports"), capacity=3)
    assert recent.claim("h:1") and recent.claim("h:2") and recent.claim("h:3")
    assert not recent.claim("h:1"), "an address among the last 3 was taken again"
    assert recent.claim("h:4")  # pushes h:1 out
    assert recent.claim("h:1"), "the oldest address was not forgotten past the capacity"
    assert not recent.claim("h:4")
    assert RecentPorts(recent.path, capacity=3).claim("other:4"), "the host is part of the address"


def test_an_unusable_file_is_logged_and_the_port_taken(tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    recent = RecentPorts(str(blocker / "ports"))
    with caplog.at_level(logging.WARNING):
        assert recent.claim("h:1")
    assert "without the check" in caplog.text


def test_the_default_file_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVOPS_MOONCAKE_PORTS_FILE", str(tmp_path / "p"))
    assert RecentPorts().path == str(tmp_path / "p")
    monkeypatch.delenv("KVOPS_MOONCAKE_PORTS_FILE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert RecentPorts().path == os.path.join(str(tmp_path), "torch_kvops", "mooncake-handshake-ports")


def test_engines_never_take_a_port_drawn_lately(tmp_path):
    recent = marked_file(tmp_path)
    ports = start_ports(recent)
    assert all(port in MOONCAKE_PORTS for port in ports), f"Mooncake drew outside its range: {ports}"
    reused = [port for port in ports if port in MARKED]
    assert not reused, f"engines took ports drawn lately: {reused}"
    with open(recent.path) as f:
        recorded = f.read().split()
    assert all(f"127.0.0.1:{port}" in recorded for port in ports), "a drawn port was not recorded"


@pytest.mark.parametrize("control", ["no_check"])
def test_negative_control_without_the_check_engines_take_recent_ports(tmp_path, control):
    ports = start_ports(NoCheck(str(tmp_path / "unused")))
    assert any(port in MARKED_FOR_CONTROL for port in ports), (
        f"{control}: no engine drew a marked port ({ports}); the test above could not tell")
