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

pytestmark = [pytest.mark.netns, pytest.mark.alone]

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


# --------------------------------------------------------------------------- detached lanes

SRC_SLOW_2, SRC_GOOD_2, DST_2 = list(range(16, 24)), list(range(24, 32)), list(range(0, 8))
DETACH_S = 0.2


@pytest.mark.parametrize("case", ["detach", "abort", "integrity_chunk", "wait"])
def test_the_next_step_does_not_wait_for_a_slow_consumer(case):
    """With ``detach_slow_lanes_after_s``, ``wait_for_save`` returns once the layers
    are handed over and the good consumer's writes are over: the slow consumer's lane
    finishes alone, and the engine's next step goes on. The next step's request to the
    good consumer lands at once; the slow consumer's lane of that step starts after the
    first one ended (both its requests land byte-exact, in order). ``abort``: the engine
    drops the slow request while its lane writes alone: no later layer of it is written,
    and it is reported failed on both sides. ``integrity_chunk``: with integrity digests,
    a chunk that is not its request's last is never left alone (the next forward writes
    the rest of its last block, and a late digest would not match): the step waits.
    Negative control (``wait``, no detaching): ``wait_for_save`` waits for the slow
    consumer's writes."""
    detach = None if case == "wait" else DETACH_S
    integrity = "checksum" if case == "integrity_chunk" else "off"
    with NetnsHost(index=4) as host:
        slow = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, host=host, **CONFIG)
        good = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
        transport = MooncakeTransport(host="127.0.0.1")
        conn = LayerwiseConnector("producer", transport, ConnectorConfig(
            **CONFIG, detach_slow_lanes_after_s=detach, integrity_check=integrity))
        caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
        try:
            conn.register_kv_caches(caches)
            peers = {"good": conn.add_peer(good.info), "slow": conn.add_peer(slow.info)}
            host.limit_rate(SLOW_LINK_BIT_S)
            gen = torch.Generator().manual_seed(3)
            for cache in caches:
                cache.copy_(torch.randn(cache.shape, generator=gen))
            first = {"good": ("good-1", SRC_GOOD, DST), "slow": ("slow-1", SRC_SLOW, DST)}
            started = time.monotonic()
            waited = _push(conn, caches, good, slow, peers, first, last_chunk=case != "integrity_chunk")
            print(case, f"wait_for_save of step 1: {waited:.2f} s")
            if case == "integrity_chunk":
                assert waited > 3.0, f"a chunk with digests was left alone ({waited:.2f} s)"
                assert conn.stats()["lanes_detached"] == 0
                return
            if case == "wait":
                assert waited > 3.0, f"the step did not wait for the slow consumer ({waited:.2f} s): " \
                                     "the control guards nothing"
                outcomes = _outcomes(conn, {"slow-1", "good-1"}, started)
                assert outcomes["slow-1"][0] == outcomes["good-1"][0] == "landed", outcomes
                return
            assert waited < 1.0, f"wait_for_save waited for the slow consumer ({waited:.2f} s)"
            assert conn.stats()["lanes_detached"] == 1
            if case == "abort":
                assert conn.abort("slow-1", "the engine dropped it")
                outcomes = _outcomes(conn, {"good-1", "slow-1"}, started)
                assert outcomes["slow-1"][0] == "failed" and outcomes["good-1"][0] == "landed", outcomes
                _, failed, _ = slow.call("wait", ["slow-1"], 30.0)
                assert failed == {"slow-1"}
                received = slow.call("caches")
                for layer in (2, 3):  # abort came during layer 0's write (~1 s each)
                    assert (received[layer][DST] == -7.0).all(), f"layer {layer} was written after the abort"
                return
            for cache in caches:  # the next step's KV: the first step's sources unchanged
                fresh = torch.randn(cache[SRC_SLOW_2 + SRC_GOOD_2].shape, generator=gen)
                cache[SRC_SLOW_2 + SRC_GOOD_2] = fresh
            second = {"good": ("good-2", SRC_GOOD_2, DST_2), "slow": ("slow-2", SRC_SLOW_2, DST_2)}
            started_2 = time.monotonic()
            _push(conn, caches, good, slow, peers, second)
            outcomes = _outcomes(conn, {"good-1", "slow-1", "good-2", "slow-2"}, started)
            print(case, {k: (v[0], round(v[1], 2)) for k, v in outcomes.items()})
            assert {k: v[0] for k, v in outcomes.items()} == dict.fromkeys(outcomes, "landed"), outcomes
            good_2_s = outcomes["good-2"][1] - (started_2 - started)
            assert good_2_s < GOOD_BOUND_S, f"step 2's good request waited {good_2_s:.2f} s"
            assert outcomes["good-2"][1] < outcomes["slow-1"][1] < outcomes["slow-2"][1], outcomes
            for consumer, name in ((good, "good"), (slow, "slow")):
                names = [f"{name}-1", f"{name}-2"]
                assert consumer.call("wait", names, 30.0)[0] == set(names)
                received = consumer.call("caches")
                for rid, src, dst in (first[name], second[name]):
                    for layer in range(LAYERS):
                        assert np.array_equal(received[layer][dst], caches[layer][src].numpy()), (rid, layer)
        finally:
            conn.close()
            transport.close()
            good.stop()
            slow.stop()


def _push(conn, caches, good, slow, peers, requests, last_chunk=True):
    """One step of ``requests`` ({"good"/"slow": (id, src, dst)}); returns how long
    ``wait_for_save`` took."""
    for name, consumer in (("good", good), ("slow", slow)):
        consumer.call("expect", [requests[name][0]])
    conn.start_step([TransferRequest(rid, peers[name], src, dst, last_chunk=last_chunk)
                     for name, (rid, src, dst) in requests.items()])
    for layer, cache in enumerate(caches):
        conn.save_kv_layer(layer, cache)
    t0 = time.monotonic()
    conn.wait_for_save(timeout=60)
    return time.monotonic() - t0


def _outcomes(conn, req_ids, started):
    """{request: (P's outcome, seconds from ``started``)}, once every request has one."""
    outcomes = {}
    deadline = time.monotonic() + 60
    while len(outcomes) < len(req_ids) and time.monotonic() < deadline:
        done, failed = conn.get_finished()
        for req_id in (done | failed) & req_ids:
            outcomes[req_id] = ("landed" if req_id in done else "failed", time.monotonic() - started)
        time.sleep(0.005)
    assert len(outcomes) == len(req_ids), f"no outcome within 60 s: {outcomes}"
    return outcomes
