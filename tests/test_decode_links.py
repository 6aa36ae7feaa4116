"""P's links to decode ranks are made off the forward path (integrations/vllm/links.py,
issue 33): a decode instance that drops every packet costs a step ``connect_wait_s``
per attempt, not the connection's timeouts and retries, and a healthy decode instance
is connected meanwhile. Real producer connector and consumer process over the real
Mooncake engine; the dropping instance is an address in a network namespace this
test creates (torch_kvops/testing/netns_host.py), reached through a veth pair whose
root side drops every packet, so a connection to it hangs as it would across a real
network."""
import time

import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport
from torch_kvops.integrations.vllm.links import DecodeLinks
from torch_kvops.integrations.vllm.metadata import KvopsSettings
from torch_kvops.integrations.vllm.metrics import StatsCollector
from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.netns_host import NetnsHost

pytestmark = [pytest.mark.netns]

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 16, (2, 8, 16)
CONFIG = dict(transfer_timeout_s=3.0, max_retries=1, control_timeout_s=2.0)
CONNECT_WAIT_S = 0.3


@pytest.fixture
def dropping_address():
    """An address every packet to which is dropped; namespace and link removed after."""
    with NetnsHost(index=1) as host:
        host.drop_inbound()
        yield host.address


def _dropping_info(good_info: dict, address: str) -> dict:
    """A decode rank whose every packet is dropped: the good rank's layout and secret,
    another engine id, its addresses behind the dropping link."""
    port = good_info["control_address"].rsplit(":", 1)[1]
    return dict(good_info, engine_id="dropping-decode", control_address=f"{address}:{port}",
                data_address=f"{address}:{good_info['data_address'].rsplit(':', 1)[1]}")


@pytest.fixture
def producer():
    transport = MooncakeTransport(host="127.0.0.1")
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
    conn.register_kv_caches([torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)])
    yield conn
    conn.close()
    transport.close()


def test_a_dropping_decode_instance_costs_a_step_the_connect_wait_alone(producer, dropping_address, monkeypatch):
    """No wall-clock margin: the waits a step makes for a connection are recorded (the
    attempt waited on, and for how long): the first step waits ``connect_wait_s`` and
    goes on while the attempt is still under way (it ends only at the connection's
    timeouts), later steps wait 0 for it, and after the attempt failed (waited on as
    an event) the breaker holds further attempts back without a wait."""
    from concurrent.futures import wait as wait_for_futures

    from torch_kvops.integrations.vllm import links as links_module

    waits = []  # (the attempts waited on, timeout) of every wait a step made

    def recorded_wait(futures, timeout=None):
        waits.append((list(futures), timeout))
        return wait_for_futures(futures, timeout=timeout)

    monkeypatch.setattr(links_module, "wait", recorded_wait)
    attempts = []  # the decode engine ids an attempt was started for
    add_peer = producer.add_peer
    monkeypatch.setattr(producer, "add_peer", lambda info: attempts.append(info["engine_id"])
                        or add_peer(info))
    good = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
    metrics = StatsCollector("producer")
    links = DecodeLinks(producer, KvopsSettings(connect_wait_s=CONNECT_WAIT_S), metrics)
    try:
        bad_info = _dropping_info(good.info, dropping_address)
        started = time.monotonic()
        assert links.peer(bad_info) is None  # the step goes on without it
        first_wait = time.monotonic() - started
        (([attempt], first_timeout),) = waits
        # it went on while the attempt was under way: not held for the connection's timeouts
        assert not attempt.done(), "the step waited for the connection to end"
        assert 0 < first_timeout <= CONNECT_WAIT_S and first_wait >= CONNECT_WAIT_S - 0.05, (first_timeout, first_wait)
        # the connection goes on (2 s timeout, 1 retry); a step does not wait for it again,
        # and a healthy decode instance connects meanwhile
        started = time.monotonic()
        assert links.peer(bad_info) is None
        again = time.monotonic() - started
        assert waits[1] == ([attempt], 0.0), waits  # its wait had ended: no wait again
        good_peer = links.peer(good.info)
        healthy = time.monotonic() - started
        assert good_peer is not None and links.peer(good.info) == good_peer
        print(f"first wait {first_wait:.3f} s, again {again:.3f} s, healthy connect {healthy:.3f} s")
        # the attempt fails at the connection's own bound; its failure is noted by the next
        # request that needs it, and the breaker holds further attempts back
        assert wait_for_futures([attempt], timeout=30).done, "the attempt never ended"
        assert attempt.exception() is not None, "the dropping decode instance was connected"
        waited = len(waits)
        assert links.peer(bad_info) is None and links.peer(bad_info) is None
        assert waits[waited:] == [([attempt], 0.0)], waits[waited:]  # its end noted, no wait
        assert attempts.count("dropping-decode") == 1, attempts  # held back: no other attempt
        assert links._breaker.states()["dropping-decode"]["failures"] == 1
        # the gauges: one link live (the healthy one), one decode rank backing off
        gauges = metrics.take(producer.stats).data
        assert (gauges["links_change"], gauges["links_backing_off_change"]) == (1, 1), gauges
        assert metrics._pending.data.get("peer_connect_pending", 0) == 0  # taken above
    finally:
        started = time.monotonic()
        links.close()
        assert time.monotonic() - started < 2 * CONFIG["control_timeout_s"] + 2.0
        good.stop()


def test_without_the_connect_thread_a_dropping_decode_instance_stalls_the_step(producer, dropping_address):
    """Negative control: the connection made inline (as before links.py) holds the step
    for every timeout and retry of the connection."""
    good = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
    try:
        started = time.monotonic()
        with pytest.raises((ConnectionError, OSError)):
            producer.add_peer(_dropping_info(good.info, dropping_address))
        stalled = time.monotonic() - started
        print(f"inline connect stalled the step {stalled:.2f} s")
        assert stalled >= CONFIG["control_timeout_s"]
    finally:
        good.stop()
