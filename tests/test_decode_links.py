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


def test_a_dropping_decode_instance_costs_a_step_the_connect_wait_alone(producer, dropping_address):
    good = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
    metrics = StatsCollector("producer")
    links = DecodeLinks(producer, KvopsSettings(connect_wait_s=CONNECT_WAIT_S), metrics)
    try:
        bad_info = _dropping_info(good.info, dropping_address)
        started = time.monotonic()
        assert links.peer(bad_info) is None  # the step goes on without it
        first_wait = time.monotonic() - started
        # the connection goes on (2 s timeout, 1 retry); a step does not wait for it again,
        # and a healthy decode instance connects meanwhile
        started = time.monotonic()
        assert links.peer(bad_info) is None
        again = time.monotonic() - started
        good_peer = links.peer(good.info)
        healthy = time.monotonic() - started
        assert good_peer is not None and links.peer(good.info) == good_peer
        print(f"first wait {first_wait:.3f} s, again {again:.3f} s, healthy connect {healthy:.3f} s")
        assert CONNECT_WAIT_S - 0.05 <= first_wait < CONNECT_WAIT_S + 0.5, first_wait
        assert again < 0.1, again
        # the attempt fails at the connection's own bound; its failure is noted by the next
        # request that needs it, and the breaker holds further attempts back
        time.sleep(2 * CONFIG["control_timeout_s"] + 1.0)
        started = time.monotonic()
        assert links.peer(bad_info) is None and links.peer(bad_info) is None
        assert time.monotonic() - started < 0.1
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
