"""CUDA backend of the kvops ops under the default copy policy (copy kernel for small
descriptors; DMA for large runs and pageable memory: batch engine on a side stream,
per-copy on the legacy default stream and under graph capture), layer events and the
ready queue, eagerly and inside captured CUDA graphs. test_cuda_copy_kernel.py forces
each copy path.

Needs a GPU and a CUDA build of the extension; skipped where CUDA is unavailable."""
import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

import torch_kvops  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
KMAX = 8192  # kMaxDescriptorsPerCall in csrc/core/block_plan.h


# ---------------------------------------------------------------------------------------
# Helpers


def random_cache(num_blocks, block_shape, dtype, device, pin=False, seed=0):
    """A [num_blocks, *block_shape] tensor of random bytes (any bit pattern, NaNs too)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = (num_blocks, *block_shape[:-1], block_shape[-1] * itemsize)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    t = raw.view(dtype)
    if device.type == "cuda":
        return t.to(device)
    return t.pin_memory() if pin else t.clone()


def zeros_like_cache(num_blocks, block_shape, dtype, device, pin=False):
    t = torch.zeros((num_blocks, *block_shape), dtype=dtype, device=device)
    return t.pin_memory() if pin else t


def as_bytes(t):
    return t.detach().contiguous().view(torch.uint8).cpu()


def reference_swap(src, dst, mapping):
    """Pure-torch result of swap_blocks_batch, computed on the CPU."""
    out = [as_bytes(d).clone() for d in dst]
    s_idx, d_idx = mapping[:, 0], mapping[:, 1]
    for i, s in enumerate(src):
        out[i][d_idx] = as_bytes(s)[s_idx]
    return out


def assert_bytes_equal(dst, expected):
    for i, (d, e) in enumerate(zip(dst, expected)):
        got = as_bytes(d)
        if not torch.equal(got, e):
            bad = (got != e).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
            raise AssertionError(f"layer {i}: blocks {bad[:20]} differ from the reference")


def scattered_mapping(rows, num_src, num_dst, seed=0):
    """Rows with random, mostly non-adjacent (src, dst) pairs plus one contiguous run,
    so that both single-block and merged descriptors are exercised."""
    g = torch.Generator().manual_seed(seed)
    run = min(8, rows // 4)  # rows [0, run): blocks 0.. -> the last `run` dst blocks
    src = torch.randperm(num_src, generator=g)[:rows]
    src[:run] = torch.arange(run)
    rest = torch.randperm(num_dst - run, generator=g)[: rows - run]  # destinations stay unique
    dst = torch.cat([torch.arange(num_dst - run, num_dst), rest])
    return torch.stack([src, dst], dim=1).to(torch.int64)


DIRECTIONS = {
    # name: (src device, src pinned, dst device, dst pinned)
    "h2d": ("cpu", True, "cuda", False),
    "d2h": ("cuda", False, "cpu", True),
    "d2d": ("cuda", False, "cuda", False),
    "h2d_pageable": ("cpu", False, "cuda", False),
    "d2h_pageable": ("cuda", False, "cpu", False),
}


def make_case(direction, layers=3, num_blocks=64, block_shape=(16, 2, 8), dtype=torch.bfloat16,
              rows=40, seed=0):
    s_dev, s_pin, d_dev, d_pin = DIRECTIONS[direction]
    s_dev = DEV if s_dev == "cuda" else torch.device("cpu")
    d_dev = DEV if d_dev == "cuda" else torch.device("cpu")
    src = [random_cache(num_blocks, block_shape, dtype, s_dev, s_pin, seed + i) for i in range(layers)]
    dst = [zeros_like_cache(num_blocks, block_shape, dtype, d_dev, d_pin) for _ in range(layers)]
    mapping = scattered_mapping(rows, num_blocks, num_blocks, seed)
    return src, dst, mapping


def run_on(stream_kind, fn):
    """Runs fn with the legacy default stream ("default") or a side stream ("side")
    current, then waits for that stream."""
    if stream_kind == "default":
        with torch.cuda.stream(torch.cuda.default_stream(DEV)):
            fn()
        torch.cuda.default_stream(DEV).synchronize()
        return
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))  # sources were written on it
    with torch.cuda.stream(side):
        fn()
    side.synchronize()



def test_build_has_cuda():
    assert torch_kvops.build_info()["cuda"], "torch_kvops was built without its CUDA backend"


# ---------------------------------------------------------------------------------------
# opcheck


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_opcheck_swap_blocks_batch(direction):
    src, dst, mapping = make_case(direction, layers=2, num_blocks=16, rows=6)
    torch.library.opcheck(torch.ops.kvops.swap_blocks_batch.default, (src, dst, mapping))


def test_opcheck_swap_blocks_batch_ptrs():
    src = random_cache(8, (64,), torch.float16, DEV)
    dst = torch.zeros_like(src)
    block = src[0].numel() * src.element_size()
    sp = torch.tensor([src.data_ptr() + k * block for k in (1, 3, 5)], dtype=torch.int64)
    dp = torch.tensor([dst.data_ptr() + k * block for k in (0, 2, 4)], dtype=torch.int64)
    sizes = torch.full((3,), block, dtype=torch.int64)
    torch.library.opcheck(torch.ops.kvops.swap_blocks_batch.ptrs, (sp, dp, sizes))
    torch.cuda.synchronize()
    for s, d in ((1, 0), (3, 2), (5, 4)):
        assert torch.equal(as_bytes(dst[d]), as_bytes(src[s]))


def test_opcheck_record_layer_event_and_push_layer():
    kv = torch.zeros(4, 128, device=DEV)
    with torch_kvops.LayerEvents(2, DEV) as ev:
        torch.library.opcheck(torch.ops.kvops.record_layer_event.default, (kv, ev.handle, 1))
        torch.library.opcheck(torch.ops.kvops.push_layer.default, (kv, ev.handle, 1))
        assert ev.next_ready(timeout=1.0) == 1
        assert ev.wait(1, timeout=10.0)


# ---------------------------------------------------------------------------------------
# swap_blocks_batch, eager


@pytest.mark.parametrize("stream_kind", ["side", "default"])
@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
def test_swap_blocks_batch_matches_reference(direction, stream_kind):
    src, dst, mapping = make_case(direction, seed=7)
    expected = reference_swap(src, dst, mapping)
    run_on(stream_kind, lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    assert_bytes_equal(dst, expected)


@pytest.mark.parametrize("stream_kind", ["side", "default"])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_swap_blocks_batch_more_descriptors_than_one_call(direction, stream_kind):
    # 2 layers x 5000 scattered 64-byte blocks: more than kMaxDescriptorsPerCall merged
    # descriptors, so the copy is split into several submissions.
    src, dst, mapping = make_case(direction, layers=2, num_blocks=6000, block_shape=(32,),
                                  dtype=torch.float16, rows=5000, seed=3)
    mapping = mapping[8:]  # drop the contiguous run: every row is its own descriptor
    assert 2 * mapping.shape[0] > KMAX
    expected = reference_swap(src, dst, mapping)
    run_on(stream_kind, lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    assert_bytes_equal(dst, expected)


def test_swap_blocks_batch_in_place_within_one_cache():
    cache = random_cache(32, (8, 16), torch.float32, DEV, seed=5)
    before = as_bytes(cache).clone()
    mapping = torch.tensor([[0, 10], [1, 11], [5, 20]], dtype=torch.int64)
    run_on("side", lambda: torch_kvops.swap_blocks_batch([cache], [cache], mapping))
    expected = before.clone()
    expected[mapping[:, 1]] = before[mapping[:, 0]]
    assert torch.equal(as_bytes(cache), expected)


def test_swap_blocks_batch_orders_after_prior_stream_work(cycles_per_ms):
    # The source is written by a kernel that runs long after the copy was issued: the
    # copy must still read the new values (source access in stream order).
    src = torch.zeros(16, 4096, device=DEV)
    dst = torch.zeros(16, 4096, device="cpu").pin_memory()
    mapping = torch.tensor([[k, k] for k in range(16)], dtype=torch.int64)
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(cycles_per_ms * 50))
        src.fill_(3.0)
        torch_kvops.swap_blocks_batch([src], [dst], mapping)
    side.synchronize()
    assert torch.all(dst == 3.0)


def test_swap_blocks_batch_rejects_bad_input_and_leaves_dst_untouched():
    src, dst, _ = make_case("d2d", layers=2, num_blocks=8, rows=4)
    bad = torch.tensor([[0, 1], [9, 2]], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch_kvops.swap_blocks_batch(src, dst, bad)
    with pytest.raises(RuntimeError, match="must be on the CPU"):
        torch_kvops.swap_blocks_batch(src, dst, torch.tensor([[0, 1]], device=DEV))
    with pytest.raises(RuntimeError, match="device"):
        torch_kvops.swap_blocks_batch([src[0], src[1].cpu()], dst, torch.tensor([[0, 1]]))
    torch.cuda.synchronize()
    assert all(torch.count_nonzero(as_bytes(d)) == 0 for d in dst)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_swap_blocks_batch_across_devices():
    other = torch.device("cuda", (DEV.index + 1) % torch.cuda.device_count())
    src = [random_cache(16, (256,), torch.float16, other, seed=11)]
    dst = [torch.zeros(16, 256, dtype=torch.float16, device=DEV)]
    mapping = scattered_mapping(10, 16, 16, seed=2)
    expected = reference_swap(src, dst, mapping)
    torch.cuda.synchronize(other)
    run_on("side", lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    assert_bytes_equal(dst, expected)


# ---------------------------------------------------------------------------------------
# swap_blocks_batch.ptrs


def ptr_case(direction, rows=20, seed=0):
    src, dst, mapping = make_case(direction, layers=1, rows=rows, seed=seed)
    s, d = src[0], dst[0]
    block = s[0].numel() * s.element_size()
    sp = torch.tensor([s.data_ptr() + int(r) * block for r in mapping[:, 0]], dtype=torch.int64)
    dp = torch.tensor([d.data_ptr() + int(r) * block for r in mapping[:, 1]], dtype=torch.int64)
    sizes = torch.full((rows,), block, dtype=torch.int64)
    return src, dst, mapping, (sp, dp, sizes)


@pytest.mark.parametrize("stream_kind", ["side", "default"])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_swap_blocks_batch_ptrs_device_memory(direction, stream_kind):
    src, dst, mapping, args = ptr_case(direction, seed=4)
    expected = reference_swap(src, dst, mapping)
    run_on(stream_kind, lambda: torch_kvops.swap_blocks_batch_ptrs(*args))
    assert_bytes_equal(dst, expected)


def test_swap_blocks_batch_ptrs_host_memory_still_copies():
    src = [random_cache(16, (64,), torch.float32, torch.device("cpu"), seed=9)]
    dst = [torch.zeros(16, 64)]
    block = 64 * 4
    mapping = torch.tensor([[2, 0], [7, 5]], dtype=torch.int64)
    sp = torch.tensor([src[0].data_ptr() + 2 * block, src[0].data_ptr() + 7 * block])
    dp = torch.tensor([dst[0].data_ptr(), dst[0].data_ptr() + 5 * block])
    expected = reference_swap(src, dst, mapping)
    torch_kvops.swap_blocks_batch_ptrs(sp, dp, torch.tensor([block, block]))
    assert_bytes_equal(dst, expected)


# ---------------------------------------------------------------------------------------
# CUDA graphs: copies


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_swap_blocks_batch_captured_copies_on_every_replay(direction):
    src, dst, mapping = make_case(direction, layers=2, seed=21)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch_kvops.swap_blocks_batch(src, dst, mapping)
    torch.cuda.synchronize()
    assert all(torch.count_nonzero(as_bytes(d)) == 0 for d in dst), "capture must not copy"
    for step in range(3):
        for i, s in enumerate(src):
            s.copy_(random_cache(s.shape[0], tuple(s.shape[1:]), s.dtype, s.device,
                                 seed=100 * step + i))
        for d in dst:
            d.zero_()
        torch.cuda.synchronize()
        expected = reference_swap(src, dst, mapping)
        g.replay()
        torch.cuda.synchronize()
        assert_bytes_equal(dst, expected)


def test_swap_blocks_batch_ptrs_captured_copies_on_every_replay():
    src, dst, mapping, args = ptr_case("d2h", seed=8)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch_kvops.swap_blocks_batch_ptrs(*args)
    torch.cuda.synchronize()
    assert torch.count_nonzero(as_bytes(dst[0])) == 0
    for step in range(2):
        src[0].copy_(random_cache(src[0].shape[0], tuple(src[0].shape[1:]), src[0].dtype, DEV,
                                  seed=50 + step))
        dst[0].zero_()
        torch.cuda.synchronize()
        expected = reference_swap(src, dst, mapping)
        g.replay()
        torch.cuda.synchronize()
        assert_bytes_equal(dst, expected)


# ---------------------------------------------------------------------------------------
# Layer events


def read_on_independent_stream(t):
    """Copies t to the host on a fresh stream that is NOT ordered after the current one,
    so the values seen are what the device has actually written so far."""
    reader = torch.cuda.Stream(t.device)
    with torch.cuda.stream(reader):
        out = t.to("cpu")
    return out


def test_layer_events_in_cuda_graph(cycles_per_ms):
    layers = 4
    kv = [torch.zeros(8, 1024, device=DEV) for _ in range(layers)]
    value = torch.zeros((), device=DEV)
    ev = torch_kvops.LayerEvents(layers, DEV)
    slow = int(cycles_per_ms * 20)  # ~20 ms of "attention" before each KV write
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(layers):
            torch.cuda._sleep(slow)
            kv[i].copy_((value + i).expand_as(kv[i]))
            torch_kvops.record_layer_event(kv[i], ev.handle, i)
            torch_kvops.push_layer(kv[i], ev.handle, i)
    torch.cuda.synchronize()
    assert ev.next_ready(timeout=0.05) is None, "capture must not push"
    try:
        for step in range(1, 5):
            value.fill_(100.0 * step)
            g.replay()
            for i in range(layers):
                layer = ev.next_ready(timeout=30.0)
                assert layer == i, f"replay {step}: expected layer {i}, got {layer}"
                assert ev.wait(layer, timeout=30.0) is True
                got = read_on_independent_stream(kv[layer])
                assert torch.all(got == 100.0 * step + layer), (
                    f"replay {step}, layer {layer}: event completed before the KV write")
            torch.cuda.synchronize()
        assert ev.next_ready(timeout=0.05) is None
    finally:
        torch.cuda.synchronize()
        del g  # the graph records these events: it must go before the pool does
        ev.close()


@pytest.mark.parametrize("stream_kind", ["current", "side"])
def test_eager_wait_times_out_until_the_record_completes(cycles_per_ms, stream_kind):
    kv = torch.zeros(4, 256, device=DEV)
    ev = torch_kvops.LayerEvents(2, DEV)
    stream = torch.cuda.current_stream(DEV) if stream_kind == "current" else torch.cuda.Stream(DEV)
    stream.wait_stream(torch.cuda.current_stream(DEV))
    try:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(cycles_per_ms * 500))
            kv.fill_(7.0)
            torch_kvops.record_layer_event(kv, ev.handle, 1)
            torch_kvops.push_layer(kv, ev.handle, 1)
        assert ev.next_ready(timeout=5.0) == 1  # eager push: immediately on the host
        t0 = time.monotonic()
        assert ev.wait(1, timeout=0.02) is False
        assert time.monotonic() - t0 < 0.4
        assert ev.wait(1, timeout=60.0) is True
        assert torch.all(read_on_independent_stream(kv) == 7.0)
    finally:
        torch.cuda.synchronize()
        ev.close()


def test_waiter_thread_does_not_break_global_mode_capture():
    kv = torch.zeros(4, 256, device=DEV)
    ev = torch_kvops.LayerEvents(1, DEV)
    torch_kvops.record_layer_event(kv, ev.handle, 0)
    torch.cuda.synchronize()
    stop, errors, polls = threading.Event(), [], [0]

    def waiter():
        while not stop.is_set():
            try:
                ev.wait(0, timeout=0.001)  # polls cudaEventQuery
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                return
            polls[0] += 1

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    x = torch.zeros(1 << 16, device=DEV)
    try:
        deadline = time.monotonic() + 10
        while polls[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="global"):
            for _ in range(200):
                x.add_(1.0)
            torch_kvops.record_layer_event(x, ev.handle, 0)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not errors, errors
    assert polls[0] > 0
    g.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 200.0)
    del g  # the graph records ev's event: it must go before the pool does
    ev.close()


def test_layer_events_errors():
    kv = torch.zeros(4, 16, device=DEV)
    with torch_kvops.LayerEvents(2, DEV) as ev:
        with pytest.raises(RuntimeError, match="out of range"):
            torch_kvops.record_layer_event(kv, ev.handle, 2)
        with pytest.raises(RuntimeError, match="lives on"):
            torch_kvops.push_layer(kv.cpu(), ev.handle, 0)
        handle = ev.handle
    with pytest.raises(RuntimeError, match="unknown or closed handle"):
        torch_kvops.record_layer_event(kv, handle, 0)


def test_bound_layer_rejects_other_cuda_tensor():
    cache, other = torch.zeros(4, 16, device=DEV), torch.zeros(4, 16, device=DEV)
    with torch_kvops.LayerEvents(1, DEV) as ev:
        ev.bind(0, cache)
        torch_kvops.record_layer_event(cache, ev.handle, 0)
        torch_kvops.push_layer(cache, ev.handle, 0)
        with pytest.raises(RuntimeError, match="temporary copy"):
            torch_kvops.record_layer_event(other, ev.handle, 0)
        with pytest.raises(RuntimeError, match="temporary copy"):
            torch_kvops.push_layer(other, ev.handle, 0)
        assert ev.next_ready(timeout=1.0) == 0
        assert ev.next_ready(timeout=0.05) is None
