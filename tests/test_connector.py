"""LayerwiseConnector between real processes over the real Mooncake engine (TCP, loopback)."""
import threading
import time

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest

from torch_kvops.testing.consumer_process import ConsumerProcess

pytestmark = [pytest.mark.process]

LAYERS, BLOCKS, BLOCK_SHAPE = 4, 64, (2, 8, 16)  # 1 KiB blocks
FAST = dict(transfer_timeout_s=3.0, max_retries=1, retry_backoff_s=0.02, lease_s=10.0,
            control_timeout_s=2.0, quarantine_s=0.1,
            # these consumers take pushes they were not told to expect unless a test
            # expects; the default (refused) is tests/test_admission.py's
            accept_unsolicited_pushes=True)


@pytest.fixture
def consumer():
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST)
    yield proc
    proc.stop()


@pytest.fixture
def producer():
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**FAST))
    conn.register_kv_caches(caches)
    yield conn, caches
    conn.close()
    transport.close()


def forward(conn, caches, blocks, seed):
    """Stand-in for a model forward: write each layer's new KV blocks, then hook."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(blocks, dtype=torch.long)
    for layer, cache in enumerate(caches):
        cache.index_copy_(0, idx, torch.randn(len(blocks), *BLOCK_SHAPE, generator=gen))
        conn.save_kv_layer(layer, cache)


def assert_landed(received, caches, pairs, untouched_value=-7.0):
    written = np.zeros(BLOCKS, dtype=bool)
    for src, dst in pairs:
        written[dst] = True
        for layer in range(LAYERS):
            assert np.array_equal(received[layer][dst], caches[layer][src].numpy()), (layer, src, dst)
    for layer in range(LAYERS):
        assert (received[layer][~written] == untouched_value).all(), "bytes outside the mapping changed"


def test_requests_and_chunked_prefill_land_byte_exact(consumer, producer):
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    step1 = [TransferRequest("a", peer, [0, 1, 2], [10, 11, 12]),
             TransferRequest("b", peer, [5, 9], [3, 40]),
             TransferRequest("c", peer, [20, 21], [50, 51], last_chunk=False)]
    conn.start_step(step1)
    forward(conn, caches, [0, 1, 2, 5, 9, 20, 21], seed=1)
    conn.wait_for_save(timeout=30)
    finished, failed, _ = consumer.call("wait", ["a", "b", "c"], 1.0)
    assert finished == {"a", "b"} and not failed, "c must wait for its last chunk"

    conn.start_step([TransferRequest("c", peer, [22], [52], last_chunk=True)])
    forward(conn, caches, [22], seed=2)
    conn.wait_for_save(timeout=30)
    finished, failed, _ = consumer.call("wait", ["c"], 10.0)
    assert finished == {"c"} and not failed

    received = consumer.call("caches")
    assert_landed(received, caches, [(0, 10), (1, 11), (2, 12), (5, 3), (9, 40),
                                     (20, 50), (21, 51), (22, 52)])
    done, bad = set(), set()
    deadline = time.monotonic() + 5
    while done != {"a", "b", "c"} and time.monotonic() < deadline:
        f, x = conn.get_finished()
        done |= f
        bad |= x
    assert done == {"a", "b", "c"} and not bad
    stats = conn.stats()
    assert stats["bytes_sent"] == 8 * LAYERS * 1024 and stats["requests_finished"] == 3
    assert stats["layers_sent"] == 2 * LAYERS and len(stats["layer_wait_s_mean"]) == LAYERS


@pytest.mark.parametrize("staging", [True, False], ids=["staged", "direct"])
def test_thousands_of_fragmented_blocks_arrive_intact(staging):
    layers, blocks, shape = 2, 8192, (64,)  # 256-byte blocks, 3000 fragmented per layer
    # Small slots so that a layer spans several slots and slots are reused (acks).
    # A generous write timeout: thousands of tiny direct descriptors are slow on a
    # loaded 2-core machine, and this test is about integrity, not speed.
    config = dict(FAST, transfer_timeout_s=30.0, staging_slot_bytes=64 << 10, staging_slots=3,
                  staging_threshold_bytes=(256 << 10) if staging else 0)
    consumer = ConsumerProcess(layers, blocks, shape, **config)
    transport = MooncakeTransport(host="127.0.0.1")
    try:
        caches = [torch.randn(blocks, *shape) for _ in range(layers)]
        with LayerwiseConnector("producer", transport, ConnectorConfig(**config)) as conn:
            conn.register_kv_caches(caches)
            peer = conn.add_peer(consumer.info)
            rng = np.random.default_rng(0)
            src = rng.choice(blocks, 3000, replace=False)
            dst = rng.choice(blocks, 3000, replace=False)
            conn.start_step([TransferRequest("frag", peer, src.tolist(), dst.tolist())])
            for layer, cache in enumerate(caches):
                conn.save_kv_layer(layer, cache)
            conn.wait_for_save(timeout=60)
            finished, failed, _ = consumer.call("wait", ["frag"], 30.0)
            assert finished == {"frag"}, (finished, failed)
            received = consumer.call("caches")
            for layer in range(layers):
                assert np.array_equal(received[layer][dst], caches[layer][src].numpy())
                untouched = np.ones(blocks, dtype=bool)
                untouched[dst] = False
                assert (received[layer][untouched] == -7.0).all()
            staged = conn.stats()["staged_writes"]
            assert (staged >= 2 * 12) if staging else (staged == 0)
    finally:
        consumer.stop()
        transport.close()


def test_killed_consumer_fails_only_its_requests(producer):
    conn, caches = producer
    alive, doomed = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST), \
        ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST)
    try:
        p_alive, p_doomed = conn.add_peer(alive.info), conn.add_peer(doomed.info)
        conn.start_step([TransferRequest("x1", p_alive, [0], [0]), TransferRequest("y1", p_doomed, [1], [1])])
        forward(conn, caches, [0, 1], seed=3)
        conn.wait_for_save(timeout=30)
        doomed.kill()
        started = time.monotonic()
        conn.start_step([TransferRequest("x2", p_alive, [2, 3], [2, 3]),
                         TransferRequest("y2", p_doomed, [4], [4])])
        forward(conn, caches, [2, 3, 4], seed=4)
        conn.wait_for_save(timeout=60)
        elapsed = time.monotonic() - started
        bound = (FAST["max_retries"] + 1) * (FAST["transfer_timeout_s"] + 1) + 2
        assert elapsed < bound, f"dead peer held the step for {elapsed:.1f} s"
        finished, failed = set(), set()
        deadline = time.monotonic() + 5
        while "y2" not in failed and time.monotonic() < deadline:
            f, x = conn.get_finished()
            finished |= f
            failed |= x
            time.sleep(0.01)
        assert {"x1", "y1", "x2"} <= finished and failed == {"y2"}
        # The producer keeps serving the live consumer.
        conn.start_step([TransferRequest("x3", p_alive, [5], [5]), TransferRequest("y3", p_doomed, [6], [6])])
        forward(conn, caches, [5, 6], seed=5)
        conn.wait_for_save(timeout=30)
        got, _, _ = alive.call("wait", ["x1", "x2", "x3"], 10.0)
        assert got == {"x1", "x2", "x3"}
        received = alive.call("caches")
        for layer in range(LAYERS):
            for b in (0, 2, 3, 5):
                assert np.array_equal(received[layer][b], caches[layer][b].numpy())
    finally:
        alive.stop()
        doomed.kill()


def test_bad_plans_are_rejected_before_anything_is_sent(consumer, producer):
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    conn.start_step([TransferRequest("held", peer, [0], [0], last_chunk=False)])
    forward(conn, caches, [0], seed=6)
    conn.wait_for_save(timeout=30)
    sent_before = conn.stats()["bytes_sent"]
    bad_plans = {
        "unknown peer": [TransferRequest("r", "nobody", [1], [1])],
        "length mismatch": [TransferRequest("r", peer, [1, 2], [1])],
        "source out of range": [TransferRequest("r", peer, [BLOCKS], [1])],
        "negative source": [TransferRequest("r", peer, [-1], [1])],
        "destination out of range": [TransferRequest("r", peer, [1], [BLOCKS + 5])],
        "duplicate destination": [TransferRequest("r", peer, [1, 2], [7, 7])],
        "duplicate destination across requests": [TransferRequest("r", peer, [1], [7]),
                                                  TransferRequest("s", peer, [2], [7])],
        "request twice in a step": [TransferRequest("r", peer, [1], [7]), TransferRequest("r", peer, [2], [8])],
    }
    for name, plan in bad_plans.items():
        try:
            conn.start_step(plan)
        except ValueError:
            continue
        pytest.fail(f"bad plan accepted: {name}")
    other = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **FAST)
    try:
        other_peer = conn.add_peer(other.info)
        with pytest.raises(ValueError, match="in flight"):
            conn.start_step([TransferRequest("held", other_peer, [1], [1])])
    finally:
        other.stop()
    assert conn.stats()["bytes_sent"] == sent_before
    received = consumer.call("caches")
    for layer in range(LAYERS):
        assert (received[layer][1:] == -7.0).all()


def test_a_refused_request_fails_alone_and_leaves_no_holes(consumer, producer):
    """partial=True: a bad request is refused alone (the others go); its consumer hears
    at once that it failed, keeping what landed before; its later chunks are dropped,
    so no destination is filled around a missing chunk."""
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    consumer.call("expect", ["ok", "cut", "clash"])
    conn.start_step([TransferRequest("cut", peer, [0, 1], [20, 21], last_chunk=False)])
    forward(conn, caches, [0, 1], seed=3)
    conn.wait_for_save(timeout=30)
    started = time.monotonic()
    refused = conn.start_step([TransferRequest("ok", peer, [4, 5], [30, 31]),
                               TransferRequest("cut", peer, [2, BLOCKS], [22, 23], last_chunk=False),
                               TransferRequest("clash", peer, [6], [31])], partial=True)
    assert set(refused) == {"cut", "clash"}
    assert "out of range" in refused["cut"] and "named twice" in refused["clash"]
    forward(conn, caches, [2, 4, 5, 6], seed=4)
    conn.wait_for_save(timeout=30)
    assert conn.start_step([TransferRequest("cut", peer, [3], [23])], partial=True) == {}
    forward(conn, caches, [3], seed=5)
    conn.wait_for_save(timeout=30)
    assert conn.stats()["chunks_after_failure"] == 1  # cut's last chunk: dropped
    finished, failed, _ = consumer.call("wait", ["ok", "cut", "clash"], 10.0)
    assert finished == {"ok"} and failed == {"cut", "clash"}
    assert time.monotonic() - started < 5.0, "the consumer heard at once, not at its lease"
    assert consumer.call("landed") == {"cut": [[20, 21]], "clash": []}
    received = consumer.call("caches")
    for layer in range(LAYERS):
        assert np.array_equal(received[layer][[30, 31]], caches[layer][[4, 5]].numpy())
        assert np.array_equal(received[layer][[20, 21]], caches[layer][[0, 1]].numpy())
        assert (received[layer][[22, 23]] == -7.0).all(), "a chunk after the refused one landed"
    _, producer_failed = conn.get_finished()
    assert producer_failed == {"cut", "clash"}


def test_expect_after_a_fast_producer_finished_still_gets_the_report_and_a_reused_id_does_not(
        consumer, producer):
    """The engine may expect a request after its producer finished it (P was faster
    than D's step): the next get_finished reports it. Once reported, the same id
    expected again is refused (False): nothing would ever report it."""
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    conn.start_step([TransferRequest("fast", peer, [0], [3])])
    forward(conn, caches, [0], seed=1)
    conn.wait_for_save(timeout=30)
    deadline = time.monotonic() + 10
    while consumer.call("stats")["requests_finished"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert consumer.call("expect", ["fast"]) == [True]
    assert consumer.call("wait", ["fast"], 5.0)[0] == {"fast"}
    assert consumer.call("expect", ["fast"]) == [False]


def test_incompatible_peer_layout_rejected(producer):
    conn, _ = producer
    other = ConsumerProcess(LAYERS, BLOCKS, (2, 8, 8), **FAST)
    try:
        with pytest.raises(ValueError, match="bytes"):
            conn.add_peer(other.info)
    finally:
        other.stop()


def test_close_during_a_step_reports_unfinished_requests_failed(consumer):
    transport = MooncakeTransport(host="127.0.0.1")
    caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    conn = LayerwiseConnector("producer", transport, ConnectorConfig(**FAST))
    conn.register_kv_caches(caches)
    peer = conn.add_peer(consumer.info)
    conn.start_step([TransferRequest("cut", peer, [0, 1], [0, 1])])
    conn.save_kv_layer(0, caches[0])  # the rest of the forward never happens
    threads_before = {t.name for t in threading.enumerate()}
    assert "kvops-sender" in threads_before
    conn.close(timeout=10)
    assert "kvops-sender" not in {t.name for t in threading.enumerate()}
    finished, failed = conn.get_finished()
    assert failed == {"cut"} and not finished
    _, consumer_failed, _ = consumer.call("wait", ["cut"], 5.0)
    assert consumer_failed == {"cut"}
    transport.close()


def test_consumer_lease_expires_for_a_request_that_never_arrives():
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **dict(FAST, lease_s=0.5))
    try:
        proc.call("expect", ["ghost"])
        started = time.monotonic()
        finished, failed, _ = proc.call("wait", ["ghost"], 5.0)
        assert failed == {"ghost"} and not finished
        assert time.monotonic() - started < 3.0
    finally:
        proc.stop()


def test_a_renewed_lease_outlives_its_term_until_max_wait():
    """renew() (the producer said it still owes the push) keeps a request alive past
    lease_s, never past max_wait_s; a request nobody renews fails at lease_s."""
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **dict(FAST, lease_s=0.6, max_wait_s=2.5))
    try:
        proc.call("expect", ["kept", "ghost"])
        started = time.monotonic()
        failed_at = {}
        while "kept" not in failed_at and time.monotonic() - started < 6.0:
            renewed = proc.call("renew", ["kept", "unknown"])
            _, failed = proc.call("drain")
            for req_id in failed:
                failed_at[req_id] = time.monotonic() - started
            assert renewed[1] is False  # never expected here
            assert renewed[0] is True or "kept" in failed_at
            time.sleep(0.1)
        _, failed = proc.call("drain")
        failed_at.update({r: time.monotonic() - started for r in failed})
        print(f"lease 0.6 s, max wait 2.5 s, renewed every 0.1 s: failed at {failed_at}")
        assert 2.3 < failed_at["kept"] < 3.5 and failed_at["ghost"] < 1.5, failed_at
    finally:
        proc.stop()


def test_a_lease_nobody_renews_ends_at_its_term():
    """Negative control of the test above: the same request without renewals."""
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **dict(FAST, lease_s=0.6, max_wait_s=2.5))
    try:
        proc.call("expect", ["kept"])
        started = time.monotonic()
        _, failed, _ = proc.call("wait", ["kept"], 5.0)
        assert failed == {"kept"} and time.monotonic() - started < 1.5
    finally:
        proc.stop()


def test_wait_for_finished_wakes_when_a_transfer_lands_and_not_without_one(consumer, producer):
    """An idle engine waits in wait_for_finished instead of polling get_finished: each
    side wakes when its transfer ends (not at its timeout), and returns at once when
    nothing is in flight; with ``while_idle`` (a thread that only collects outcomes,
    as the SGLang backend's) it waits while nothing is in flight too, and wakes when a
    transfer started meanwhile ends."""
    conn, caches = producer
    woke, waited = consumer.call("wait_for_finished", 10.0)
    assert woke is False and waited < 5.0  # nothing expected: returns, not at its timeout
    assert conn.wait_for_finished(2.0) is False  # nothing pushed: no wait
    started = time.monotonic()
    assert conn.wait_for_finished(0.3, while_idle=True) is False
    assert time.monotonic() - started >= 0.25, "an outcome thread would spin"
    collected = {}

    def collect():
        began = time.monotonic()
        collected["woke"] = conn.wait_for_finished(10.0, while_idle=True)
        collected["waited"] = time.monotonic() - began
    collector = threading.Thread(target=collect)
    collector.start()

    peer = conn.add_peer(consumer.info)
    consumer.call("expect", ["a"])

    def push_later():
        time.sleep(0.3)
        conn.start_step([TransferRequest("a", peer, [0, 1], [4, 5])])
        forward(conn, caches, [0, 1], seed=3)
    pusher = threading.Thread(target=push_later)
    pusher.start()
    try:
        woke, waited = consumer.call("wait_for_finished", 10.0)
    finally:
        pusher.join()
        collector.join(15.0)
    assert woke is True and 0.25 < waited < 5.0, waited
    assert collected["woke"] is True and 0.25 < collected["waited"] < 5.0, collected
    assert consumer.call("drain") == (["a"], [])
    started = time.monotonic()
    assert conn.wait_for_finished(10.0) is True  # the push's acknowledgement
    assert time.monotonic() - started < 5.0
    assert conn.get_finished() == ({"a"}, set())


class TinyModel(torch.nn.Module):
    """Each layer projects the hidden state into K/V, scatters it into its cache
    in place, and calls the connector hook."""

    def __init__(self, conn, caches):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.ModuleList(torch.nn.Linear(32, 2 * 8 * 16) for _ in range(LAYERS))
        self.conn, self.caches = conn, caches

    def forward(self, x, slots):
        for layer, cache in enumerate(self.caches):
            kv = self.proj[layer](x).view(-1, *BLOCK_SHAPE)
            cache.index_copy_(0, slots, kv)
            self.conn.save_kv_layer(layer, cache)
            x = torch.relu(x + kv.view(x.shape[0], -1)[:, :32])
        return x


@pytest.fixture
def patient_consumer():
    """A consumer whose lease outlasts a first torch.compile on a loaded machine (the
    request is begun before the compiled forward runs)."""
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **dict(FAST, lease_s=180.0))
    yield proc
    proc.stop()


def test_compiled_model_forward_pushes_the_same_bytes_as_eager(patient_consumer, producer):
    consumer = patient_consumer
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    model = TinyModel(conn, caches)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(4, 32)
    with torch.no_grad():
        conn.start_step([TransferRequest("eager", peer, [0, 1, 2, 3], [0, 1, 2, 3])])
        model(x, torch.tensor([0, 1, 2, 3]))
        conn.wait_for_save(timeout=30)
        eager_cache = [c.clone() for c in caches]
        conn.start_step([TransferRequest("compiled", peer, [8, 9, 10, 11], [8, 9, 10, 11])])
        compiled(x, torch.tensor([8, 9, 10, 11]))
        conn.wait_for_save(timeout=30)
    assert counter.frame_count == 1
    finished, failed, _ = consumer.call("wait", ["eager", "compiled"], 10.0)
    assert finished == {"eager", "compiled"}
    received = consumer.call("caches")
    for layer in range(LAYERS):
        # byte-exact against what the producer holds, and the same values as eager
        assert np.array_equal(received[layer][8:12], caches[layer][8:12].numpy())
        assert np.array_equal(received[layer][0:4], eager_cache[layer][0:4].numpy())
        np.testing.assert_allclose(received[layer][8:12], received[layer][0:4], rtol=1e-5, atol=1e-5)


class AttentionStub(torch.nn.Module):
    """An attention module that writes its layer's KV in place; the model code does
    not call the connector: ``attach`` hooks it."""

    def __init__(self, cache, seed):
        super().__init__()
        self.cache, self.seed = cache, seed

    def forward(self, slots):
        gen = torch.Generator().manual_seed(self.seed)
        self.cache.index_copy_(0, slots, torch.randn(len(slots), *BLOCK_SHAPE, generator=gen))
        return slots


def test_attach_installs_forward_hooks(consumer, producer):
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    layers = torch.nn.ModuleList(AttentionStub(c, seed=i) for i, c in enumerate(caches))
    handles = conn.attach(layers, list(layers))
    assert len(handles) == LAYERS
    conn.start_step([TransferRequest("hooked", peer, [3, 4], [30, 31])])
    slots = torch.tensor([3, 4])
    for layer in layers:
        layer(slots)
    conn.wait_for_save(timeout=30)
    finished, _, _ = consumer.call("wait", ["hooked"], 10.0)
    assert finished == {"hooked"}
    received = consumer.call("caches")
    assert_landed(received, caches, [(3, 30), (4, 31)])
    with pytest.raises(ValueError, match="layers given"):
        conn.attach(layers, list(layers)[:2])


def test_consumer_refuses_a_request_it_already_gave_up_on(producer):
    conn, caches = producer
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **dict(FAST, lease_s=0.3))
    try:
        peer = conn.add_peer(proc.info)
        proc.call("expect", ["late"])
        _, failed, _ = proc.call("wait", ["late"], 5.0)
        assert failed == {"late"}  # the decode engine recomputes and reuses the blocks
        conn.start_step([TransferRequest("late", peer, [1, 2], [5, 6])])
        forward(conn, caches, [1, 2], seed=7)
        conn.wait_for_save(timeout=30)
        _, producer_failed = conn.get_finished()
        assert producer_failed == {"late"}
        assert conn.stats()["bytes_sent"] == 0, "nothing may be written into reused blocks"
        finished, _, _ = proc.call("wait", ["late"], 0.5)
        assert not finished, "a request is reported once"
        received = proc.call("caches")
        assert all((received[layer] == -7.0).all() for layer in range(LAYERS))
    finally:
        proc.stop()


@pytest.mark.parametrize("integrity", [False, True], ids=["plain", "integrity"])
def test_a_request_aborted_part_way_reports_its_landed_chunks_to_the_consumer(producer, integrity):
    """Two chunks land, then the producer's engine drops the request: the consumer hears
    it at once (not at lease expiry) and knows which blocks are whole, in order; with
    the integrity check on, unverified chunks are not vouched for."""
    conn, caches = producer
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, **dict(FAST, lease_s=60.0,
                                                               integrity_check=integrity))
    try:
        peer = conn.add_peer(proc.info)
        for src, dst, seed in (([0, 1, 2], [10, 11, 12], 1), ([2, 3], [12, 13], 2)):
            conn.start_step([TransferRequest("cut", peer, src, dst, last_chunk=False)])
            forward(conn, caches, src, seed=seed)
            conn.wait_for_save(timeout=30)
        assert not conn.abort("never-started"), "only in-flight requests can be aborted"
        started = time.monotonic()
        assert conn.abort("cut", "dropped by the engine")
        _, failed, _ = proc.call("wait", ["cut"], 10.0)
        assert failed == {"cut"} and time.monotonic() - started < 5.0, "the consumer must not wait for its lease"
        landed = proc.call("landed")["cut"]
        if integrity:
            assert landed == []
        else:
            assert landed == [[10, 11, 12], [12, 13]]
            received = proc.call("caches")
            for src, dst in ((0, 10), (1, 11), (2, 12), (3, 13)):
                for layer in range(LAYERS):
                    assert np.array_equal(received[layer][dst], caches[layer][src].numpy())
        _, producer_failed = conn.get_finished()
        assert producer_failed == {"cut"}
        assert not conn.abort("cut"), "an outcome is decided once"
    finally:
        proc.stop()


def test_a_bad_control_message_drops_only_its_connection(consumer, producer):
    import json
    import socket

    host, port = consumer.info["control_address"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as rogue:
        rogue.sendall(json.dumps({"op": "scatter", "layer": 99, "slot": 0, "dst": [1]}).encode() + b"\n")
        rogue.settimeout(5)
        assert rogue.recv(100) == b"", "the consumer must close the offending connection"
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    assert conn.add_peer(consumer.info) == peer  # the same peer again: same id, no new resources
    conn.start_step([TransferRequest("after", peer, [0], [0])])
    forward(conn, caches, [0], seed=8)
    conn.wait_for_save(timeout=30)
    finished, _, _ = consumer.call("wait", ["after"], 10.0)
    assert finished == {"after"}


def test_caches_the_transport_cannot_move_are_refused_up_front():
    transport = MooncakeTransport(host="127.0.0.1")
    try:
        conn = LayerwiseConnector("producer", transport)
        with pytest.raises(ValueError, match="cannot move meta memory"):
            conn.register_kv_caches([torch.empty(4, 2, device="meta")])
        assert transport.supports_device("cpu")
    finally:
        transport.close()


def test_step_trace_names_each_moment_and_staging_runs_the_device_pipeline_steps(consumer, producer):
    """CPU caches go through the same staging steps as CUDA caches (gather, staged,
    write, scatter): a fragmented step fills ``staged``; a contiguous one goes direct."""
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    rng = np.random.default_rng(5)
    fragmented = (rng.choice(BLOCKS, 24, replace=False).tolist(),
                  rng.choice(BLOCKS, 24, replace=False).tolist())
    contiguous = (list(range(40, 64)), list(range(40, 64)))
    for req_id, (src, dst), staged in (("frag", fragmented, True), ("run", contiguous, False)):
        before = conn.stats()["staged_writes"]
        conn.start_step([TransferRequest(req_id, peer, src, dst)])
        issued = []
        gen = torch.Generator().manual_seed(9)
        idx = torch.tensor(src, dtype=torch.long)
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, idx, torch.randn(len(src), *BLOCK_SHAPE, generator=gen))
            issued.append(time.perf_counter())
            conn.save_kv_layer(layer, cache)
        conn.wait_for_save(timeout=30)
        trace = conn.last_step_trace()
        assert [t["layer"] for t in trace] == list(range(LAYERS))
        for t, at in zip(trace, issued):
            # "pushed" is the model's push (same clock as perf_counter), not the sender's take
            assert at <= t["pushed"] <= at + 0.05, (t, at)
            assert t["pushed"] <= t["taken"] <= t["event_ready"] <= t["landed"], t
            if staged:
                assert t["event_ready"] <= t["staged"] <= t["landed"], t
            else:
                assert t["staged"] is None, t
        assert (conn.stats()["staged_writes"] > before) == staged
        finished, failed, _ = consumer.call("wait", [req_id], 10.0)
        assert finished == {req_id} and not failed
        received = consumer.call("caches")
        for layer in range(LAYERS):
            for s, d in zip(src, dst):
                assert np.array_equal(received[layer][d], caches[layer][s].numpy()), (req_id, layer)
