"""No late byte into a finished request (issue 58, item 1). A layer write to D times
out while its bytes are held back on Mooncake lanes, its retry lands on a free lane,
and the timed-out attempt's transfers (orphans) still run: they read P's source blocks
whenever the lane moves again, and land in D's blocks. P says a request's last chunk
(which lets D report it finished and hand its blocks to the engine) only once no such
transfer runs; one still running after ``quarantine_s`` fails the request, and D fences
its blocks until no write of it can land.

D runs on an emulated second host (testing/netns_host.py): the lanes' packets to it are
held back with ``tc`` (``NetnsHost.hold_back``) until the orphans are known, then only
the orphans' lanes stay held. As soon as P reports the request, the test reuses its
source blocks (writes 99.0 into them, as the engine would); the lanes recover after.
Real producer connector and consumer process over the real Mooncake engine."""
import contextlib
import subprocess
import time
from collections import Counter

import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.connector.peer_step import PeerStep
from torch_kvops.testing.consumer_process import ConsumerProcess
from torch_kvops.testing.netns_host import NetnsHost
from torch_kvops.testing.pushes import producer_outcome

pytestmark = [pytest.mark.netns]

LAYERS, BLOCKS, BLOCK_SHAPE = 1, 8, (2, 1024, 512)  # 4 MiB blocks: most of an orphan's bytes
SRC, DST = [0, 1], [4, 5]                            # are read from the source after the reuse
CONFIG = dict(transfer_timeout_s=1.0, max_retries=2, retry_backoff_s=1.0, control_timeout_s=2.0,
              lease_s=20.0, fence_drain_s=4.0, step_timeout_s=30.0)
REUSED = 99.0


def _connections(address):
    """(bytes not yet acknowledged, local port, remote port) of this namespace's TCP
    connections to ``address``."""
    out = subprocess.run(["ss", "-tnH", "state", "established", "dst", address],
                         capture_output=True, text=True, check=True, timeout=10).stdout
    rows = []
    for line in out.splitlines():
        _recv_q, send_q, local, remote = line.split()[:4]
        rows.append((int(send_q), int(local.rsplit(":", 1)[1]), int(remote.rsplit(":", 1)[1])))
    return rows


@contextlib.contextmanager
def _held_pair(config):
    """D on an emulated host, P here, one request pushed so that the lanes are open.
    Yields (host, consumer, transport, conn, caches, push, lane port); ``push(req_id)`` starts
    a step for the request with fresh source bytes and returns them."""
    with NetnsHost(index=5) as host:
        consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, host=host, **config)
        transport = MooncakeTransport(host="127.0.0.1")
        conn = LayerwiseConnector("producer", transport, ConnectorConfig(**config))
        try:
            caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
            conn.register_kv_caches(caches)
            peer = conn.add_peer(consumer.info)

            def push(req_id):
                consumer.call("expect", [req_id])
                for cache in caches:
                    cache[SRC] = torch.randn(len(SRC), *BLOCK_SHAPE)
                conn.start_step([TransferRequest(req_id, peer, SRC, DST)])
                for layer, cache in enumerate(caches):
                    conn.save_kv_layer(layer, cache)
                return [cache[SRC].clone() for cache in caches]

            push("warm-up")  # opens the lanes, so the test knows their port
            assert producer_outcome(conn, "warm-up", 30.0)
            conn.wait_for_save(timeout=30)
            control = int(consumer.info["control_address"].rsplit(":", 1)[1])
            handshake = int(consumer.info["data_address"].rsplit(":", 1)[1])
            lane_port = Counter(p for _, _, p in _connections(host.address)
                                if p not in (control, handshake)).most_common(1)[0][0]
            yield host, consumer, transport, conn, caches, push, lane_port
        finally:
            conn.close()
            transport.close()
            consumer.stop()


def _push_with_a_held_lane(quarantine_s, heal_after_retry_s=None, wait_for_orphans=True,
                           monkeypatch=None):
    """Push one request while its first write's transfers stay held back. Returns (P
    finished it, D finished it, D's blocks equal the bytes P held when it pushed)."""
    if not wait_for_orphans:  # P before this issue: a last chunk while orphans run
        monkeypatch.setattr(PeerStep, "_left_behind_writes_ended", lambda self, timeout_s: True)
    with _held_pair(dict(CONFIG, quarantine_s=quarantine_s)) as (host, consumer, transport, conn,
                                                                 caches, push, lane_port):
        host.hold_back("dport", [lane_port])
        pushed = push("A")
        deadline = time.monotonic() + 10
        while transport.outstanding() == 0:  # the first write timed out: orphans
            assert time.monotonic() < deadline, "the held write never timed out"
            time.sleep(0.005)
        orphaned = time.monotonic()
        held = [local for unacked, local, remote in _connections(host.address)
                if remote == lane_port and unacked > 0]
        assert held, "no lane holds the timed-out write's bytes"
        host.hold_back("sport", held)  # the retry (after retry_backoff_s) moves on a free lane
        if heal_after_retry_s is not None:
            time.sleep(CONFIG["retry_backoff_s"] + heal_after_retry_s - (time.monotonic() - orphaned))
            host.heal()
        p_finished = producer_outcome(conn, "A", 30.0)
        for cache in caches:  # the engine reuses the source blocks at once
            cache[SRC] = REUSED
        conn.wait_for_save(timeout=30)
        time.sleep(0.5)
        host.heal()
        deadline = time.monotonic() + 35
        while transport.outstanding():
            assert time.monotonic() < deadline, "the orphans never ended"
            time.sleep(0.01)
        finished, failed, _ = consumer.call("wait", ["A"], 30.0)
        assert "A" in finished | failed, "D never reported the request"
        received = consumer.call("caches")
        exact = all(np.array_equal(received[layer][DST], pushed[layer].numpy()) for layer in range(LAYERS))
        return p_finished, "A" in finished, exact


def test_orphans_that_outlive_the_quarantine_fail_the_request_on_both_sides():
    p_finished, d_finished, _ = _push_with_a_held_lane(quarantine_s=0.3)
    assert not p_finished and not d_finished


def test_orphans_that_end_within_the_quarantine_let_the_request_finish_byte_exact():
    p_finished, d_finished, exact = _push_with_a_held_lane(quarantine_s=8.0, heal_after_retry_s=0.5)
    assert p_finished and d_finished and exact


def test_negative_control_a_last_chunk_sent_while_orphans_run_lets_the_reused_source_land(monkeypatch):
    """P before this issue (the last chunk without waiting for the orphans): D reports
    the request finished, then the orphans land the reused source's bytes in it."""
    p_finished, d_finished, exact = _push_with_a_held_lane(quarantine_s=0.3, wait_for_orphans=False,
                                                           monkeypatch=monkeypatch)
    assert d_finished and not exact


@pytest.mark.parametrize("check", [True, False], ids=["stops", "control_retries_anyway"])
def test_no_write_starts_after_the_consumer_dropped_the_session(monkeypatch, check):
    """D drops P's session (a malformed message on it, as it would for any fault of that
    producer) while P's first write of a layer is held back: P starts no retry after
    that (issue 58, item 6), where it used to retry the layer into blocks D fenced. The
    control's P never sees its channel close (as testing/producer_process.py's frozen
    producer)."""
    from torch_kvops.control import ControlClient
    if not check:
        monkeypatch.setattr(ControlClient, "peer_closed", lambda self: False)
    # the first attempt times out 2.7 s after D dropped the session: a slow drop still comes first
    config = dict(CONFIG, quarantine_s=0.3, max_retries=3, retry_backoff_s=0.2, transfer_timeout_s=3.0)
    with _held_pair(config) as (host, consumer, transport, conn, caches, push, lane_port):
        host.hold_back("dport", [lane_port])
        errors = conn.stats()["transport_errors"]
        push("A")
        time.sleep(0.3)  # the write is on the held lanes
        link = conn._side._peers[next(iter(conn._side._peers))]
        link.control.send({"op": "scatter", "layer": 99, "slot": 0, "dst": [1]})  # D drops it
        assert not producer_outcome(conn, "A", 30.0)
        attempts = conn.stats()["transport_errors"] - errors
        conn.wait_for_save(timeout=30)
        host.heal()
        if check:
            assert attempts == 1, f"{attempts} write attempts; none may start after the drop"
        else:
            assert attempts == config["max_retries"] + 1
