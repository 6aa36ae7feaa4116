"""The fence (docs/connector.md): once the consumer has reported a transfer failed, no
byte of that transfer lands in its blocks. Real producer and consumer processes over
the real Mooncake engine (TCP, loopback).

Each case: the consumer gives up on a request while its producer is still in the
middle of the push; right after the consumer reports the failure, the test writes a
sentinel into the request's destination blocks (as the engine would when it hands them
to another request); once the producer's step is over, the sentinel must be intact on
every layer. Negative control: the same with the producer's side of the fence switched
off (``fence="off"``: it ignores its write lease and the consumer's revokes): the
producer's later layers overwrite the sentinel.
"""
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.producer_process import ProducerProcess

pytestmark = [pytest.mark.process]

LAYERS, BLOCKS, BLOCK_SHAPE = 4, 32, (2, 8, 16)  # 1 KiB blocks
# Contiguous blocks: one descriptor per layer, written straight into the consumer's KV
# cache (a staged write is scattered by the consumer, which refuses revoked requests).
SRC, DST = [0, 1, 2, 3], [10, 11, 12, 13]
LEASE_S, DRAIN_S = 0.5, 0.3
CONFIG = dict(transfer_timeout_s=3.0, max_retries=0, control_timeout_s=2.0, quarantine_s=0.1,
              lease_s=LEASE_S, fence_drain_s=DRAIN_S)
PUSHED, SENTINEL, UNTOUCHED = 5.0, 99.0, -7.0


@pytest.fixture
def consumer():
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **CONFIG)
    yield proc
    proc.stop()


def _producer(fence: str) -> ProducerProcess:
    return ProducerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, fence=fence, **CONFIG)


def _layers_landed(consumer) -> int:
    caches = consumer.call("caches")
    return sum(bool((c[DST] == PUSHED).all()) for c in caches)


def _give_up_then_sentinel(consumer, producer, req_id: str, gap_s: float, freeze_s: float = 0.0) -> dict:
    """Push ``req_id`` with ``gap_s`` between layers; once layer 0 landed, freeze the
    producer for ``freeze_s`` (0: leave it running, stalled by its slow layers). Fill
    the sentinel as soon as the consumer reports the failure; return what happened."""
    peer = producer.call("add_peer", consumer.info)
    consumer.call("expect", [req_id])
    producer.send("push", req_id, peer, SRC, DST, PUSHED, gap_s)
    deadline = time.monotonic() + 10
    while _layers_landed(consumer) < 1:
        assert time.monotonic() < deadline, "layer 0 never landed"
        time.sleep(0.01)
    frozen_at = time.monotonic()
    if freeze_s:
        os.kill(producer.proc.pid, signal.SIGSTOP)
    try:
        finished, failed, _ = consumer.call("wait", [req_id], 10.0)
        reported_after = time.monotonic() - frozen_at
        consumer.call("fill", DST, SENTINEL)
        landed_at_report = _layers_landed(consumer)
        if freeze_s:
            time.sleep(max(0.0, freeze_s - (time.monotonic() - frozen_at)))
    finally:
        if freeze_s:
            os.kill(producer.proc.pid, signal.SIGCONT)
    p_finished, p_failed, p_stats = producer.reply(timeout=60)
    caches = consumer.call("caches")
    return {"finished": finished, "failed": failed, "reported_after": reported_after,
            "landed_at_report": landed_at_report, "producer_failed": p_failed,
            "producer_stats": p_stats, "consumer_stats": consumer.call("stats"),
            "sentinel_layers": [bool((c[DST] == SENTINEL).all()) for c in caches],
            "outside_untouched": all(bool((np.delete(c, DST, axis=0) == UNTOUCHED).all()) for c in caches)}


def test_a_stalled_producer_stops_when_revoked_and_the_blocks_return_within_the_lease():
    """The producer is alive but its layers come slower than the lease: the consumer
    revokes the request, the producer stops it and acknowledges, and the consumer
    reports it at once, long before the drain bound (30 s here); the producer's later
    layers are never written."""
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **dict(CONFIG, fence_drain_s=30.0))
    producer = _producer(fence="full")
    try:
        run = _give_up_then_sentinel(consumer, producer, "stalled", gap_s=2.0)
    finally:
        producer.stop()
        consumer.stop()
    assert run["failed"] == {"stalled"} and not run["finished"]
    assert run["reported_after"] < LEASE_S + 1.0, "reported after the acknowledgement, not the bound"
    assert run["sentinel_layers"] == [True] * LAYERS, f"a write landed after the report: {run}"
    assert run["outside_untouched"]
    assert run["producer_failed"] == ["stalled"]
    assert run["producer_stats"]["failed_revoked"] == 1
    assert run["consumer_stats"]["fenced"] == 1 and run["consumer_stats"]["revokes_acknowledged"] == 1


@pytest.mark.parametrize("fence", ["full", "lease"])
def test_a_frozen_producer_writes_nothing_when_it_resumes(consumer, fence):
    """SIGSTOP past two leases, then SIGCONT, repeated: the frozen producer cannot
    acknowledge, so the consumer reports at the bound (lease end + drain); every time,
    the resumed producer finds the request revoked (``full``) or, with revokes ignored
    (``lease``), its write lease over, and writes no further layer."""
    producer = _producer(fence=fence)
    try:
        runs = [_give_up_then_sentinel(consumer, producer, f"frozen-{i}", gap_s=0.3,
                                       freeze_s=2 * LEASE_S + DRAIN_S)
                for i in range(FROZEN_REPEATS)]
    finally:
        producer.stop()
    for i, run in enumerate(runs):
        assert run["failed"] == {f"frozen-{i}"}
        assert run["sentinel_layers"] == [True] * LAYERS, f"run {i}: a write landed after the report"
        assert run["outside_untouched"]
        assert run["producer_failed"] == [f"frozen-{i}"]
        assert run["reported_after"] >= DRAIN_S  # the bound: nobody acknowledged
    stats = runs[-1]["producer_stats"]
    if fence == "lease":
        assert stats["write_lease_ended"] == FROZEN_REPEATS and stats["failed_revoked"] == 0
    else:
        assert stats["write_lease_ended"] + stats["failed_revoked"] == FROZEN_REPEATS
    print(f"{FROZEN_REPEATS} freezes ({fence}): reported after "
          f"{sorted(round(r['reported_after'], 2) for r in runs)} s, 0 sentinel bytes overwritten; "
          f"stopped by the write lease {stats['write_lease_ended']}x, by the revoke {stats['failed_revoked']}x")


FROZEN_REPEATS = 10  # per fence mode: 20 freezes in all


@pytest.mark.parametrize("freeze", [False, True], ids=["stalled", "frozen"])
def test_negative_control_without_the_write_lease_the_sentinel_is_overwritten(consumer, freeze):
    producer = _producer(fence="off")
    try:
        run = _give_up_then_sentinel(consumer, producer, "unfenced", gap_s=2.0 if not freeze else 0.3,
                                     freeze_s=(2 * LEASE_S + DRAIN_S) if freeze else 0.0)
    finally:
        producer.stop()
    assert run["failed"] == {"unfenced"}
    assert not all(run["sentinel_layers"]), "the control must see late writes land"


def test_a_request_the_consumer_refused_before_it_began_is_never_written(consumer):
    """The consumer's engine gave up on a transfer before any producer began it (its
    post got no answer, and the producer may have accepted it all the same): the
    producer's begin is refused, the producer fails the request and writes nothing."""
    producer = _producer(fence="full")
    try:
        peer = producer.call("add_peer", consumer.info)
        consumer.call("refuse", ["refused"])
        consumer.call("fill", DST, SENTINEL)
        finished, failed, stats = producer.call("push", "refused", peer, SRC, DST, PUSHED, 0.0)
        assert failed == ["refused"] and finished == []
        assert stats["bytes_sent"] == 0 and stats["failed_rejected_by_decode"] == 1
        caches = consumer.call("caches")
        assert all((c[DST] == SENTINEL).all() for c in caches)
        # a request the consumer did not refuse goes through on the same link
        consumer.call("expect", ["next"])
        finished, failed, _ = producer.call("push", "next", peer, SRC, DST, PUSHED, 0.0)
        assert finished == ["next"] and not failed
        assert all((c[DST] == PUSHED).all() for c in consumer.call("caches"))
        assert consumer.call("wait", ["next"], 5.0)[0] == {"next"}
    finally:
        producer.stop()


def _cut_control_connection(consumer) -> None:
    """Kill the TCP connection of the producer's control channel to ``consumer`` (as a
    network fault would: both ends see it reset), with ``ss -K``."""
    port = consumer.info["control_address"].rsplit(":", 1)[1]
    subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], check=True,
                   capture_output=True, timeout=10)


@pytest.mark.parametrize("fence", ["full", "off"])
def test_a_control_connection_cut_mid_push_lets_nothing_land_after_the_report(consumer, fence):
    """The control connection breaks while the producer is still pushing (its layers come
    slowly): the consumer fails the request when the connection ends, but reports it only
    after the drain; the producer, finding its channel closed, writes no further layer.
    Negative control (``off``: the producer ignores every sign that the consumer let
    go): its later layers overwrite the sentinel."""
    producer = _producer(fence=fence)
    try:
        peer = producer.call("add_peer", consumer.info)
        consumer.call("expect", ["cut"])
        producer.send("push", "cut", peer, SRC, DST, PUSHED, 2.0)
        deadline = time.monotonic() + 10
        while _layers_landed(consumer) < 1:
            assert time.monotonic() < deadline, "layer 0 never landed"
            time.sleep(0.01)
        cut_at = time.monotonic()
        _cut_control_connection(consumer)
        _, failed, _ = consumer.call("wait", ["cut"], 10.0)
        reported_after = time.monotonic() - cut_at
        consumer.call("fill", DST, SENTINEL)
        _, p_failed, _ = producer.reply(timeout=60)
        sentinel = [bool((c[DST] == SENTINEL).all()) for c in consumer.call("caches")]
        stats = consumer.call("stats")
    finally:
        producer.stop()
    assert failed == {"cut"} and p_failed == ["cut"]
    assert reported_after >= DRAIN_S and stats["failed_producer_gone"] == 1
    if fence == "full":
        assert sentinel == [True] * LAYERS, "a write landed after the report"
    else:
        assert not all(sentinel), "the control must see late writes land"


@pytest.mark.parametrize("fence", ["full", "no_renewal"])
def test_a_step_slower_than_its_lease_renews_it_while_its_layers_come(fence):
    """A slow forward, not a stopped producer: layers 0.7 s apart under a 1 s lease (the
    step lasts 2.1 s). Before each write past half its write lease, the producer
    announces the request again, which renews its lease on the consumer and grants a new
    write lease: every layer lands and the request finishes. Negative control
    (``no_renewal``): the lease ends before the third layer and the request fails."""
    config = dict(CONFIG, lease_s=1.0)
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **config)
    producer = ProducerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, fence=fence, **config)
    try:
        peer = producer.call("add_peer", consumer.info)
        consumer.call("expect", ["slow"])
        p_finished, p_failed, stats = producer.call("push", "slow", peer, SRC, DST, PUSHED, 0.7)
        finished, failed, _ = consumer.call("wait", ["slow"], 10.0)
        landed = _layers_landed(consumer)
    finally:
        producer.stop()
        consumer.stop()
    print(f"{fence}: producer finished {p_finished} failed {p_failed}; {landed} of {LAYERS} layers "
          f"landed; {stats['write_lease_renewals']} renewals, write lease ended {stats['write_lease_ended']}x")
    if fence == "no_renewal":
        # the consumer revoked it at its lease (or the write lease stopped the producer)
        assert p_failed == ["slow"] and failed == {"slow"} and landed < LAYERS
        return
    assert p_finished == ["slow"] and finished == {"slow"} and not failed
    assert landed == LAYERS and stats["write_lease_renewals"] >= 2 and stats["write_lease_ended"] == 0
