"""What a stranger on the network can read of an engine's memory over Mooncake TCP.

Mooncake's TCP server serves reads of every region registered with it to any peer that
completes its unauthenticated handshake. A producer (P) only ever writes from its KV
cache, so it keeps it out of Mooncake (``exposed=False``): a stranger process that tries
to read P's cache is refused. The controls: the same read of a region that *is* exposed
(the consumer's cache, which P must be able to write) succeeds, and a producer whose
transport is made to expose its cache is read - so the refusal is the guard's doing.
"""
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.pushes import push_and_receive
from torch_kvops.testing.stranger import read_from

import pytest

pytestmark = [pytest.mark.process]

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 8, (2, 4, 16)
SECRET = 1.25  # P's cache holds this in every element
FAST = dict(transfer_timeout_s=3.0, max_retries=1, lease_s=10.0, control_timeout_s=2.0,
            # these consumers take pushes they were not told to expect unless a test
            # expects; the default (refused) is tests/test_admission.py's
            accept_unsolicited_pushes=True)


def _producer(expose_anyway: bool):
    transport = MooncakeTransport(host="127.0.0.1")
    if expose_anyway:  # the sabotage: the cache is registered as if peers wrote into it
        register = transport.register
        transport.register = lambda ptr, length, exposed=True: register(ptr, length, exposed=True)
    caches = [torch.full((BLOCKS, *BLOCK_SHAPE), SECRET) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**FAST))
    conn.register_kv_caches(caches)
    return transport, conn, caches


def _secret_bytes(caches, length):
    return caches[0].flatten().numpy().tobytes()[:length]


@pytest.mark.parametrize("expose_anyway", [False, True], ids=["guarded", "control_exposed"])
def test_a_stranger_cannot_read_the_producer_cache_and_pushes_still_land(expose_anyway):
    transport, conn, caches = _producer(expose_anyway)
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST)
    try:
        length = 4096
        rc, data = read_from(transport.address(), caches[0].data_ptr(), length)
        if expose_anyway:
            assert rc == 0 and data == _secret_bytes(caches, length), "the control must read P's cache"
        else:
            assert rc != 0, "Mooncake served a read of P's cache to a stranger"
            assert data == bytes(length), "bytes of P's cache reached the stranger"
        # P still pushes from the cache it did not expose
        peer = conn.add_peer(consumer.info)
        received = push_and_receive(conn, caches, consumer, TransferRequest("r", peer, [1, 2], [5, 6]))
        for layer in range(LAYERS):
            assert (received[layer][[5, 6]] == SECRET).all()
    finally:
        consumer.stop()
        conn.close()
        transport.close()


def test_the_consumer_cache_is_exposed_as_writes_need_it():
    """The control of the read itself: D's cache must take P's writes, so Mooncake serves
    it, to strangers too (docs/deploy.md: the fleet key and a network policy close that)."""
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST)
    try:
        layer0 = consumer.info["layout"][0]
        rc, data = read_from(consumer.info["data_address"], layer0["base"], layer0["block_bytes"])
        assert rc == 0
        assert data == torch.full(BLOCK_SHAPE, -7.0).numpy().tobytes()
    finally:
        consumer.stop()
