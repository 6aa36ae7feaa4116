"""A slow consumer delays only its own requests (issue 33). One producer step carries a
request to a good consumer and one to a slow consumer: a real consumer process in a
network namespace this test creates, reached over a link shaped to 1 Mbit/s, so each
of its layer writes takes about a second (the transfer timeout is 2.5 s). Each peer's
part of the step runs on its own lane (connector/peer_step.py): the good request lands
byte-exact and is reported finished while the slow consumer's layers are still on the
wire; the slow one lands too, or, past the step's budget, fails alone; the producer
goes on serving. Real producer connector and consumer processes over the real
Mooncake engine.

Negative control (``one_lane``): every peer's work on the sender thread, one peer after
another (as a step with one peer runs, and every step did before the lanes): the good
request waits for the slow consumer's writes.
"""
import time

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.connector import sender
from torch_kvops.connector.peer_step import InlinePeerStep
from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.netns_host import NetnsHost

LAYERS, BLOCKS, BLOCK_SHAPE = 4, 32, (2, 8, 256)  # 16 KiB blocks
SRC_GOOD, SRC_SLOW, DST = list(range(0, 8)), list(range(8, 16)), list(range(16, 24))
SLOW_LINK_BIT_S = 1_000_000  # 8 blocks per layer: ~1.05 s per layer write to the slow consumer
CONFIG = dict(transfer_timeout_s=2.5, max_retries=0, control_timeout_s=5.0, lease_s=30.0,
              fence_drain_s=2.0, step_timeout_s=30.0)
GOOD_BOUND_S = 1.0  # the good request's outcome after the step started (alone: ~0.05 s)


@pytest.mark.parametrize("case", ["lanes", "budget", "one_lane"])
def test_a_slow_consumer_delays_only_its_own_requests(case, monkeypatch):
    if case == "one_lane":
        monkeypatch.setattr(sender, "PeerStep", InlinePeerStep)  # what a one-peer step runs
    # "budget": the step's budget ends before the slow consumer's last layer
    config = dict(CONFIG, step_timeout_s=2.5) if case == "budget" else CONFIG
    with NetnsHost(index=4) as host:
        slow = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, host=host, **config)
        good = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **config)
        transport = MooncakeTransport(host="127.0.0.1")
        conn = LayerwiseConnector("producer", transport, ConnectorConfig(**config))
        caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
        try:
            conn.register_kv_caches(caches)
            good_peer, slow_peer = conn.add_peer(good.info), conn.add_peer(slow.info)
            host.limit_rate(SLOW_LINK_BIT_S)
            outcomes = _step(conn, caches, good, slow, good_peer, slow_peer, seed=1)
            print(case, {k: (v[0], round(v[1], 2)) for k, v in outcomes.items()})
            (good_outcome, good_s), (slow_outcome, slow_s) = outcomes["good"], outcomes["slow"]
            assert good_outcome == "landed"
            if case == "budget":
                assert slow_outcome == "failed" and slow_s < 2.5 + 2 * 2.5, outcomes
            else:
                assert slow_outcome == "landed" and slow_s > 3.0, outcomes  # it was slow
            if case == "one_lane":
                assert good_s > 3.0, f"the good request did not wait: the control guards nothing ({good_s:.2f} s)"
                return
            assert good_s < GOOD_BOUND_S, f"the good request waited for the slow consumer ({good_s:.2f} s)"
            host.heal()  # the producer goes on: both consumers again, at full speed
            again = _step(conn, caches, good, slow, good_peer, slow_peer, seed=2)
            assert {k: v[0] for k, v in again.items()} == {"good": "landed", "slow": "landed"}, again
        finally:
            conn.close()
            transport.close()
            good.stop()
            slow.stop()


_seq = 0


def _step(conn, caches, good, slow, good_peer, slow_peer, seed):
    """One step: a request to each consumer. Returns {"good"/"slow": (outcome, seconds
    from the step's start to P's outcome)}; a landed request is checked byte-exact."""
    global _seq
    _seq += 1
    ids = {"good": f"good-{_seq}", "slow": f"slow-{_seq}"}
    good.call("expect", [ids["good"]])
    slow.call("expect", [ids["slow"]])
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    started = time.monotonic()
    conn.start_step([TransferRequest(ids["good"], good_peer, SRC_GOOD, DST),
                     TransferRequest(ids["slow"], slow_peer, SRC_SLOW, DST)])
    for layer, cache in enumerate(caches):
        conn.save_kv_layer(layer, cache)
    outcomes = {}
    deadline = started + 60
    while len(outcomes) < 2 and time.monotonic() < deadline:
        done, failed = conn.get_finished()
        for name, req_id in ids.items():
            if req_id in done | failed:
                outcomes[name] = ("landed" if req_id in done else "failed", time.monotonic() - started)
        time.sleep(0.005)
    conn.wait_for_save(timeout=60)
    assert len(outcomes) == 2, f"no outcome within 60 s: {outcomes}"
    for name, consumer, src in (("good", good, SRC_GOOD), ("slow", slow, SRC_SLOW)):
        if outcomes[name][0] == "landed":
            assert consumer.call("wait", [ids[name]], 30.0)[0] == {ids[name]}
            received = consumer.call("caches")
            for layer in range(LAYERS):
                assert np.array_equal(received[layer][DST], caches[layer][src].numpy()), (name, layer)
    return outcomes
