"""LayerwiseConnector with CUDA KV caches on the producer (and on a consumer in another
process, torch_kvops.testing.consumer_process), over the real Mooncake transfer engine
(TCP, loopback).

What is checked:

* a slow kernel before each layer's KV write: the consumer must receive the bytes the
  write produced, never the stale ones (the sender waits on the layer's own event);
* the same forward captured in a CUDA graph: every replay delivers every layer
  (record = external event record node, push = host node);
* layer-wise overlap with the model on torch's DEFAULT stream (where engines and most
  model code run): layer 0 has landed on the consumer before the last layer's compute
  ends, and the transfer exposed after the forward is about one layer's, eagerly and
  under graph replay;
* a CUDA consumer: bytes land in pinned staging and are scattered on the connector's
  own stream; the request is finished only after that scatter completed.

CUDA caches go through pinned host staging on a connector-owned stream, so the
transport never touches device memory: Mooncake's TCP transport would copy it with a
synchronous cudaMemcpy on the legacy default stream, behind the whole forward. Either
Mooncake wheel works (the CUDA one or mooncake-transfer-engine-non-cuda).

Needs a GPU and a CUDA build of torch_kvops; skipped only where CUDA is not available."""
import time

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

import torch_kvops  # noqa: E402
from torch_kvops import (ConnectorConfig, LayerwiseConnector, MooncakeTransport,  # noqa: E402
                         TransferRequest)
from torch_kvops.testing.consumer_process import ConsumerProcess  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
# The consumer process allocates float32 caches filled with -7.0 (torch.full's default dtype).
LAYERS, BLOCKS, BLOCK_SHAPE = 4, 64, (2, 8, 256)  # 16 KiB float32 blocks, 1 MiB per layer
BLOCK_BYTES = int(np.prod(BLOCK_SHAPE)) * 4
UNTOUCHED = -7.0  # consumer's initial value
STALE = 1.0  # producer's initial value: what a send without the event wait would ship
CONFIG = dict(transfer_timeout_s=5.0, max_retries=1, retry_backoff_s=0.02, lease_s=30.0,
              control_timeout_s=5.0, quarantine_s=0.1, event_timeout_s=30.0,
              step_timeout_s=60.0,
              # these consumers take pushes they were not told to expect (not run since
              # the core's default became refusing them: tests/test_admission.py)
              accept_unsolicited_pushes=True)
SAVE_TIMEOUT_S = 60.0  # every wait below is bounded
CONSUMER_WAIT_S = 30.0


# ---------------------------------------------------------------------------------------
# Fixtures and helpers



@pytest.fixture
def consumer():
    proc = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, timeout=120.0, **CONFIG)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def producer():
    assert torch_kvops.build_info()["cuda"], "torch_kvops was built without its CUDA backend"
    transport = MooncakeTransport(host="127.0.0.1")
    conn = None
    try:
        caches = [torch.full((BLOCKS, *BLOCK_SHAPE), STALE, device=DEV) for _ in range(LAYERS)]
        torch.cuda.synchronize()
        conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
        conn.register_kv_caches(caches)
        yield conn, caches
    finally:
        torch.cuda.synchronize()
        try:
            if conn is not None:
                conn.close()
        finally:
            transport.close()


class SlowModel:
    """Stand-in for a model forward: per layer a long kernel ("attention"), then the
    in-place KV write of this step's values at static slots, then ``save_kv_layer``.
    Its inputs are static tensors, so the forward can be captured in a CUDA graph."""

    def __init__(self, conn, caches, src_blocks, sleep_cycles):
        self.conn, self.caches = conn, caches
        self.slots = torch.tensor(list(src_blocks), dtype=torch.long, device=DEV)
        self.inputs = torch.zeros(LAYERS, len(src_blocks), *BLOCK_SHAPE, device=DEV)
        self.sleep_cycles = int(sleep_cycles)

    def set_inputs(self, values):
        """Copy ``values`` ([LAYERS, n, *BLOCK_SHAPE], CPU) in, on the current stream."""
        self.inputs.copy_(values.to(DEV))

    def forward(self):
        for layer, cache in enumerate(self.caches):
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)
            cache.index_copy_(0, self.slots, self.inputs[layer])
            self.conn.save_kv_layer(layer, cache)


def new_values(n, seed):
    """[LAYERS, n, *BLOCK_SHAPE] random float32 on the CPU (never equal to STALE)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, n, *BLOCK_SHAPE, generator=gen)


def side_stream():
    stream = torch.cuda.Stream(DEV)
    stream.wait_stream(torch.cuda.current_stream(DEV))  # the caches were written there
    return stream


def run_step(conn, requests, stream, launch):
    """One producer step: plan, launch the forward on ``stream``, wait until sent."""
    conn.start_step(requests)
    with torch.cuda.stream(stream):
        launch()
    conn.wait_for_save(timeout=SAVE_TIMEOUT_S)


def capture(model, stream):
    """Capture ``model.forward`` (torch.cuda.graph's own capture stream), after the
    caller warmed it up on ``stream``."""
    torch.cuda.current_stream(DEV).wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.forward()
    torch.cuda.synchronize()
    return graph


def same_bytes(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8),
                                                                         b.view(np.uint8))


def producer_snapshot(caches):
    torch.cuda.synchronize()
    return [c.cpu().numpy() for c in caches]


def check_delivered(consumer, caches, req_ids, pairs, all_dst, src_blocks=None, values=None):
    """The consumer reports ``req_ids`` finished (earlier requests not yet collected may
    come with them; none failed); every (src, dst) pair holds the producer's bytes
    (byte-exact) in every layer; the producer's bytes at ``src_blocks`` are ``values``
    (so they are this step's, not stale); blocks outside ``all_dst`` are untouched."""
    finished, failed, _ = consumer.call("wait", list(req_ids), CONSUMER_WAIT_S)
    assert set(req_ids) <= finished and not failed, (finished, failed)
    sent = producer_snapshot(caches)
    received = consumer.call("caches")
    if values is not None:
        for layer in range(LAYERS):
            for k, s in enumerate(src_blocks):
                assert same_bytes(sent[layer][s], values[layer][k].numpy()), (
                    f"layer {layer}: producer block {s} does not hold this step's values")
    for layer in range(LAYERS):
        for s, d in pairs:
            got = received[layer][d]
            if not same_bytes(got, sent[layer][s]):
                stale = bool((got == STALE).all())
                raise AssertionError(f"layer {layer}: consumer block {d} differs from producer block "
                                     f"{s}{' (it holds the STALE bytes)' if stale else ''}")
        untouched = np.ones(BLOCKS, dtype=bool)
        untouched[list(all_dst)] = False
        assert (received[layer][untouched] == UNTOUCHED).all(), \
            f"layer {layer}: bytes outside the mapping changed"


def producer_finished(conn, req_ids, timeout=10.0):
    want, done, bad = set(req_ids), set(), set()
    deadline = time.monotonic() + timeout
    while not want <= (done | bad) and time.monotonic() < deadline:
        f, x = conn.get_finished()
        done |= f
        bad |= x
        time.sleep(0.005)
    return done, bad


def relative_trace(trace):
    t0 = min(t["pushed"] for t in trace)
    return [{k: (round(v - t0, 4) if isinstance(v, float) else v) for k, v in t.items()}
            for t in trace]


# ---------------------------------------------------------------------------------------
# 1. A slow kernel before the KV write: the consumer gets the new bytes


@pytest.mark.parametrize("stream_kind", ["side", "default"])
def test_slow_kernel_before_kv_write_sends_the_new_bytes(consumer, producer, cycles_per_ms,
                                                         stream_kind):
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    requests = [TransferRequest("a", peer, [0, 1, 2], [10, 11, 12]),
                TransferRequest("b", peer, [5, 9], [3, 40]),
                # 8 adjacent blocks: one 128 KiB descriptor (several Mooncake TCP chunks)
                TransferRequest("run", peer, list(range(16, 24)), list(range(20, 28)))]
    pairs = [(s, d) for r in requests for s, d in zip(r.src_blocks, r.dst_blocks)]
    src = [s for s, _ in pairs]
    layer_ms = 100
    model = SlowModel(conn, caches, src, cycles_per_ms * layer_ms)
    values = new_values(len(src), seed=1)
    model.set_inputs(values)
    torch.cuda.synchronize()
    stream = side_stream() if stream_kind == "side" else torch.cuda.default_stream(DEV)

    run_step(conn, requests, stream, model.forward)

    trace = conn.last_step_trace()
    assert [t["layer"] for t in trace] == list(range(LAYERS)), relative_trace(trace)
    # ``pushed`` is when the model issued the push (eager: at issue time, before the
    # slow kernel ran); the KV write finishes ~layer_ms later. The sender must have
    # waited on layer 0's event for about that long before staging and sending it.
    waited = trace[0]["event_ready"] - trace[0]["pushed"]
    assert waited >= 0.5 * layer_ms / 1000, (
        f"layer 0's event was ready {waited * 1000:.1f} ms after its push, before its KV "
        f"write (~{layer_ms} ms) can have finished: {relative_trace(trace)}")
    for t in trace:
        assert t["pushed"] <= t["taken"] <= t["event_ready"] <= t["staged"] <= t["landed"], \
            relative_trace(trace)
    check_delivered(consumer, caches, ["a", "b", "run"], pairs, [d for _, d in pairs],
                    src_blocks=src, values=values)
    done, bad = producer_finished(conn, ["a", "b", "run"])
    assert done == {"a", "b", "run"} and not bad, (done, bad)
    stats = conn.stats()
    assert stats["bytes_sent"] == len(pairs) * LAYERS * BLOCK_BYTES, stats
    assert stats["layers_sent"] == LAYERS and stats["requests_finished"] == 3, stats
    assert stats["staged_writes"] >= LAYERS, "CUDA caches must go through host staging"
    assert stats["transport_errors"] == 0 and stats["orphan_pushes"] == 0, stats


# ---------------------------------------------------------------------------------------
# 2. CUDA graph: every replay delivers every layer


@pytest.mark.parametrize("stream_kind", ["side", "default"])
def test_cuda_graph_replays_deliver_every_layer(consumer, producer, cycles_per_ms, stream_kind):
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    src = [4, 5, 6, 30, 31]  # static slots written by the captured forward
    n = len(src)
    model = SlowModel(conn, caches, src, cycles_per_ms * 30)
    stream = side_stream() if stream_kind == "side" else torch.cuda.default_stream(DEV)
    all_dst = []
    graph = None
    try:
        for it in range(5):  # 0: eager warm-up on the side stream (torch.cuda.graph needs it)
            if it == 1:
                # The connector's LayerEvents exist since register_kv_caches: capture now.
                graph = capture(model, stream)
                assert conn.stats()["layers_sent"] == LAYERS, "capture must not send anything"
            req_id = f"iter{it}"
            dst = list(range(it * n, (it + 1) * n))  # 4,5,6 -> one run; 30,31 -> another
            all_dst += dst
            values = new_values(n, seed=100 + it)
            launch = model.forward if graph is None else graph.replay
            sent_before = conn.stats()["layers_sent"]

            def step(values=values, launch=launch):
                model.set_inputs(values)  # same stream as the forward: ordered before it
                launch()

            run_step(conn, [TransferRequest(req_id, peer, src, dst)], stream, step)

            assert conn.stats()["layers_sent"] - sent_before == LAYERS, f"iteration {it}"
            trace = conn.last_step_trace()
            assert [t["layer"] for t in trace] == list(range(LAYERS)), (it, relative_trace(trace))
            check_delivered(consumer, caches, [req_id], list(zip(src, dst)), all_dst,
                            src_blocks=src, values=values)
            done, bad = producer_finished(conn, [req_id])
            assert done == {req_id} and not bad, (it, done, bad)
        stats = conn.stats()
        # A push made during capture, or a replay pushing a layer twice, would have been
        # drained as an orphan by the next start_step.
        assert stats["orphan_pushes"] == 0, stats
        assert stats["steps"] == 5 and stats["layers_sent"] == 5 * LAYERS, stats
        assert stats["requests_finished"] == 5 and stats["requests_failed"] == 0, stats
    finally:
        torch.cuda.synchronize()
        if graph is not None:
            graph.reset()  # the graph records the connector's events: free it first


# ---------------------------------------------------------------------------------------
# 3. Layer-wise overlap: early layers land while later layers still compute


def transfer_times(trace):
    """Per layer, how long its transfer took once it could start (its event ready and
    the previous layer's writes returned)."""
    times, prev_landed = [], 0.0
    for t in trace:
        times.append(t["landed"] - max(t["event_ready"], prev_landed))
        prev_landed = t["landed"]
    return times


@pytest.mark.parametrize("stream_kind", ["default", "side"])
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_layer_zero_lands_before_the_last_layer_is_computed(consumer, producer, cycles_per_ms,
                                                            mode, stream_kind):
    conn, caches = producer
    peer = conn.add_peer(consumer.info)
    layer_ms = 200  # per-layer "attention": transfers of 256 KiB take a few ms
    src = list(range(16))  # 16 blocks of 16 KiB per layer
    warm_model = SlowModel(conn, caches, src, 0)
    timed_model = SlowModel(conn, caches, src, cycles_per_ms * layer_ms)
    # After the models' tensors were made on the current stream.
    stream = side_stream() if stream_kind == "side" else torch.cuda.default_stream(DEV)
    graph = None
    try:
        # Warm-up (handshake with the peer, first staging copies), not timed.
        warm_values = new_values(len(src), seed=7)
        run_step(conn, [TransferRequest("warm", peer, src, list(range(16, 32)))], stream,
                 lambda: (warm_model.set_inputs(warm_values), warm_model.forward()))
        all_dst = list(range(16, 32))
        if mode == "graph":
            run_step(conn, [TransferRequest("warm-graph", peer, src, list(range(32, 48)))], stream,
                     timed_model.forward)  # the warm-up torch.cuda.graph asks for
            all_dst += list(range(32, 48))
            graph = capture(timed_model, stream)
            launch = graph.replay
        else:
            launch = timed_model.forward
        values = new_values(len(src), seed=8)
        with torch.cuda.stream(stream):
            timed_model.set_inputs(values)
        dst = list(range(48, 64))
        all_dst += dst

        run_step(conn, [TransferRequest("timed", peer, src, dst)], stream, launch)

        trace = conn.last_step_trace()
        assert [t["layer"] for t in trace] == list(range(LAYERS)), relative_trace(trace)
        landed_first = trace[0]["landed"]
        forward_end = trace[-1]["event_ready"]  # the last layer's KV write completed
        # Expected: layer 0 lands ~1 x layer_ms after the start, the forward ends ~LAYERS x
        # layer_ms after it. Require at least half a layer of margin.
        assert landed_first < forward_end - 0.5 * layer_ms / 1000, (
            f"layer 0 landed {(landed_first - forward_end) * 1000:+.1f} ms relative to the end "
            f"of the forward: the transfer did not overlap later compute: {relative_trace(trace)}")
        assert all(a["event_ready"] < b["event_ready"] for a, b in zip(trace, trace[1:])), \
            relative_trace(trace)
        # What the user feels: the transfer left after the forward is about one layer's.
        exposed = trace[-1]["landed"] - forward_end
        one_layer = max(transfer_times(trace))
        assert exposed <= one_layer + 0.005, (
            f"{exposed * 1000:.1f} ms of transfer exposed after the forward, one layer takes "
            f"{one_layer * 1000:.1f} ms: {relative_trace(trace)}")
        check_delivered(consumer, caches, ["timed"], list(zip(src, dst)), all_dst,
                        src_blocks=src, values=values)
    finally:
        torch.cuda.synchronize()
        if graph is not None:
            graph.reset()  # the graph records the connector's events: free it first


# ---------------------------------------------------------------------------------------
# 4. A CUDA consumer: staging, scatter on the connector's stream, then "finished"


def test_cuda_consumer_receives_exact_bytes(producer, cycles_per_ms):
    conn, caches = producer
    consumer = ConsumerProcess(LAYERS, BLOCKS, BLOCK_SHAPE, timeout=120.0, device=str(DEV), **CONFIG)
    try:
        assert consumer.info["device"] == "cuda"
        peer = conn.add_peer(consumer.info)
        rng = np.random.default_rng(3)
        src = rng.choice(BLOCKS, 24, replace=False).tolist()
        dst = rng.choice(BLOCKS, 24, replace=False).tolist()
        model = SlowModel(conn, caches, src, cycles_per_ms * 20)
        values = new_values(len(src), seed=11)
        model.set_inputs(values)
        run_step(conn, [TransferRequest("to-gpu", peer, src, dst)], torch.cuda.default_stream(DEV),
                 model.forward)
        check_delivered(consumer, caches, ["to-gpu"], list(zip(src, dst)), dst,
                        src_blocks=src, values=values)
        assert consumer.call("stats")["requests_finished"] == 1
    finally:
        consumer.stop()
