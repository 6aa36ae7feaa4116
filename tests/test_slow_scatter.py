"""The consumer's staging scatters run off its control thread (issue 33,
connector/consumer_scatter.py). A real consumer process whose every scatter waits
before its copy (a slow device copy, injected there), real producers and Mooncake:

- a producer whose fragmented layers go through staging, and so wait for the slow
  scatters, delays no other producer: the other's request lands at once, and the
  staged one lands byte-exact by the time it is reported (its notice waited for its
  scatters). Negative control (``inline``): scatters on the control thread, as before,
  hold up the other producer.
- a request whose lease ends while a scatter into its blocks still runs is reported
  only once the copy is done, so no byte lands after the engine got its blocks back.
  Negative control (``unfenced``): reported at the fence's end, the late copy lands
  in blocks the engine has handed on.
"""
import threading
import time

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.control import ControlClient
from torch_kvops.testing.pushes import push_step
from torch_kvops.testing.consumer_process import ConsumerProcess

pytestmark = [pytest.mark.process, pytest.mark.alone]

LAYERS, BLOCKS, BLOCK_SHAPE = 2, 32, (2, 8, 256)  # 16 KiB blocks
CONFIG = dict(transfer_timeout_s=5.0, max_retries=0, control_timeout_s=10.0, lease_s=30.0,
              fence_drain_s=0.2)
SLOW_S = 1.5  # each scatter's wait before its copy
STAGED_SRC, STAGED_DST = [0, 2, 4, 6], [10, 12, 14, 16]  # fragmented: staged
DIRECT_SRC, DIRECT_DST = [20, 21, 22, 23], [20, 21, 22, 23]
DIRECT_BOUND_S = 0.75  # the direct request's push and report (alone: ~0.1 s)


def _producer(**config):
    transport = MooncakeTransport(host="127.0.0.1")
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**dict(CONFIG, **config)))
    caches = [torch.randn(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn.register_kv_caches(caches)
    return conn, transport, caches


@pytest.mark.parametrize("case", ["workers", "inline"])
def test_a_slow_scatter_delays_no_other_producer(case):
    control = "inline" if case == "inline" else None
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, slow_scatter=(SLOW_S, control), **CONFIG)
    staged, staged_transport, staged_caches = _producer()
    direct, direct_transport, direct_caches = _producer(staging_threshold_bytes=0)  # never stages
    try:
        staged_peer, direct_peer = staged.add_peer(consumer.info), direct.add_peer(consumer.info)
        consumer.call("expect", ["staged", "direct"])
        pushing = threading.Thread(target=push_step, args=(staged, staged_caches, [
            TransferRequest("staged", staged_peer, STAGED_SRC, STAGED_DST)]))
        pushing.start()
        time.sleep(0.3)  # its first scatter is running on the consumer
        started = time.monotonic()
        push_step(direct, direct_caches, [TransferRequest("direct", direct_peer, DIRECT_SRC, DIRECT_DST)])
        finished, failed, _ = consumer.call("wait", ["direct"], 30.0)
        direct_s = time.monotonic() - started
        if "staged" not in finished:  # (inline: it may end in the same poll)
            more, failed_later, _ = consumer.call("wait", ["staged"], 30.0)
            finished, failed = finished | more, failed | failed_later
        assert finished == {"direct", "staged"} and not failed
        received = consumer.call("caches")  # as the engine reads it once reported
        pushing.join(30.0)
        print(case, f"the direct request landed and was reported {direct_s:.2f} s after its step began")
        for layer in range(LAYERS):
            assert np.array_equal(received[layer][STAGED_DST], staged_caches[layer][STAGED_SRC].numpy())
            assert np.array_equal(received[layer][DIRECT_DST], direct_caches[layer][DIRECT_SRC].numpy())
        if case == "inline":
            assert direct_s > 1.0, f"the direct request did not wait: the control guards nothing ({direct_s:.2f} s)"
        else:
            assert direct_s < DIRECT_BOUND_S, f"the direct request waited for another's scatter ({direct_s:.2f} s)"
    finally:
        for conn, transport in ((staged, staged_transport), (direct, direct_transport)):
            conn.close()
            transport.close()
        consumer.stop()


FENCE_CONFIG = dict(CONFIG, lease_s=1.0, fence_drain_s=0.2)
FENCE_SLOW_S = 3.0
SENTINEL = 99.0  # what the engine writes into blocks it has handed on


@pytest.mark.parametrize("case", ["waits", "unfenced"])
def test_a_request_is_reported_only_once_its_running_scatter_is_done(case):
    control = "unfenced" if case == "unfenced" else None
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, slow_scatter=(FENCE_SLOW_S, control),
                               **FENCE_CONFIG)
    client = ControlClient(consumer.info["control_address"], timeout_s=5.0, retries=0)
    try:
        consumer.call("expect", ["r"])
        client.connect()
        assert client.handshake(consumer.info["secret"], "slow-producer", staging=True)["staging"]
        began = time.monotonic()
        client.send({"op": "begin", "reqs": ["r"], "dst": {"r": STAGED_DST}})
        assert client.receive(5.0)["rejected"] == []
        client.send({"op": "scatter", "layer": 0, "slot": 0, "dst": STAGED_DST})
        # Its lease (1 s) and fence (0.2 s) end while the scatter waits (3 s).
        finished, failed, _ = consumer.call("wait", ["r"], 10.0)
        reported_s = time.monotonic() - began
        assert failed == {"r"} and not finished
        consumer.call("fill", STAGED_DST, SENTINEL)  # the engine hands the blocks on
        time.sleep(max(0.0, FENCE_SLOW_S + 0.5 - (time.monotonic() - began)))
        after = consumer.call("caches")[0][STAGED_DST]
        print(case, f"reported failed {reported_s:.2f} s after begin; blocks after the copy: "
              f"{'untouched' if (after == SENTINEL).all() else 'overwritten'}")
        if case == "unfenced":
            assert reported_s < FENCE_SLOW_S and not (after == SENTINEL).all(), \
                "the late copy did not land: the control guards nothing"
            return
        assert reported_s >= FENCE_SLOW_S - 0.1, f"reported before its scatter was done ({reported_s:.2f} s)"
        assert (after == SENTINEL).all(), "a scatter landed in blocks the engine got back"
    finally:
        client.close()
        consumer.stop()
