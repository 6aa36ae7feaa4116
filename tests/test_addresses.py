"""Addresses by default (the host's, as vLLM picks it), never an unspecified one
advertised, and no engine reachable beyond this host without a fleet key unless told.

The suite's conftest points $VLLM_HOST_IP at loopback for the engines it starts; these
tests set or remove it themselves. The emulated three-host deployment that uses the
defaults end to end is tests/test_three_hosts.py.
"""
import json
import logging
import socket
import urllib.request

import pytest

from torch_kvops.addresses import endpoint, host_address, is_loopback, routed_address
from torch_kvops.integrations.vllm.metadata import KvopsSettings

pytestmark = [pytest.mark.unit]

# key_file: tests/conftest.py


def _routed():
    address = routed_address()
    assert address is not None, "this test needs a host with a route out (CI machines have one)"
    return address


def test_the_default_is_vllm_host_ip_else_the_routed_interface(monkeypatch):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    routed = _routed()
    assert not is_loopback(routed)
    with socket.socket() as s:  # an address of this host
        s.bind((routed, 0))
    assert host_address() == routed
    assert endpoint("") == endpoint(routed) and endpoint("").advertise == routed
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    assert endpoint("").advertise == "127.0.0.1" and endpoint("").loopback_only


def test_an_unspecified_address_is_bound_and_never_advertised(monkeypatch):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    for unspecified in ("0.0.0.0", "::"):
        where = endpoint(unspecified)
        assert where.bind == unspecified and where.advertise == _routed()
    assert endpoint("127.0.0.1").bind == endpoint("127.0.0.1").advertise == "127.0.0.1"
    assert is_loopback("localhost") and not is_loopback("0.0.0.0")


def test_an_engine_beyond_loopback_needs_a_fleet_key_or_allow_insecure(monkeypatch, key_file, caplog):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    monkeypatch.delenv("KVOPS_FLEET_KEY_FILE", raising=False)
    for extra in ({}, {"host": "0.0.0.0"}, {"host": "127.0.0.1", "side_channel_host": "0.0.0.0"}):
        with pytest.raises(ValueError, match="fleet key"):
            KvopsSettings.from_extra(extra)
    KvopsSettings.from_extra({"host": "127.0.0.1"})  # loopback only: a single host
    KvopsSettings.from_extra({"fleet_key_file": key_file})
    with caplog.at_level(logging.WARNING):
        KvopsSettings.from_extra({"allow_insecure": True})
    assert "without a fleet key" in caplog.text
    with pytest.raises(ValueError, match="allow_insecure"):
        KvopsSettings.from_extra({"allow_insecure": "yes"})


def test_the_side_channel_port_is_deterministic(monkeypatch):
    monkeypatch.delenv("KVOPS_SIDE_CHANNEL_PORT", raising=False)
    assert KvopsSettings.from_extra({"host": "127.0.0.1"}).side_channel_port == 8999
    monkeypatch.setenv("KVOPS_SIDE_CHANNEL_PORT", "9300")
    assert KvopsSettings.from_extra({"host": "127.0.0.1"}).side_channel_port == 9300
    assert KvopsSettings.from_extra({"host": "127.0.0.1", "side_channel_port": 0}).side_channel_port == 0
    with pytest.raises(ValueError, match="side_channel_port"):
        KvopsSettings.from_extra({"host": "127.0.0.1", "side_channel_port": 70000})


def test_a_prefill_bound_to_every_interface_advertises_the_hosts_address(monkeypatch, key_file):
    from torch_kvops.integrations.vllm.scheduler import ProducerScheduler
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        boot_port = s.getsockname()[1]
    settings = KvopsSettings.from_extra({"host": "0.0.0.0", "side_channel_port": 0, "fleet_key_file": key_file,
                                         "bootstrap_server_address": f"0.0.0.0:{boot_port}"})
    sched = ProducerScheduler(settings, block_size=16, tp_size=1, engine_id="p")
    try:
        host, port = sched.server.address.rsplit(":", 1)
        assert host == _routed()
        with urllib.request.urlopen(f"http://{_routed()}:{boot_port}/query", timeout=5) as response:
            answer = json.loads(response.read())
        assert answer["0"]["kvops"]["side_channel"] == f"{_routed()}:{port}"
        with socket.create_connection(("127.0.0.1", int(port)), timeout=5):
            pass  # bound to every interface: loopback too
    finally:
        sched.shutdown()


def test_a_taken_default_side_channel_port_stops_the_prefill_with_the_setting_to_change(monkeypatch):
    from torch_kvops.integrations.vllm.scheduler import ProducerScheduler
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        monkeypatch.setenv("KVOPS_SIDE_CHANNEL_PORT", str(port))
        with pytest.raises(OSError, match="KVOPS_SIDE_CHANNEL_PORT"):
            ProducerScheduler(KvopsSettings.from_extra({"host": "127.0.0.1", "bootstrap_endpoint": False}),
                              block_size=16)
