"""The CUDA copy kernel path of swap_blocks_batch (and .ptrs): every copy policy, both
stream kinds, graph capture with replays of new source bytes, odd sizes and unaligned
addresses, pageable host memory (DMA), 100k descriptors, and rejected input.

Needs a GPU and a CUDA build of the extension; skipped where CUDA is unavailable."""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

import torch_kvops  # noqa: E402
from torch_kvops import _C  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
K = _C._kernel_constants()


@pytest.fixture
def policy():
    """Yields set_copy_policy; restores the policy afterwards."""
    old = torch_kvops.get_copy_policy()
    yield torch_kvops.set_copy_policy
    torch_kvops.set_copy_policy(**old)


def random_bytes(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def place(t, where):
    """where: 'pinned', 'pageable' or 'cuda'."""
    if where == "cuda":
        return t.to(DEV)
    return t.pin_memory() if where == "pinned" else t.clone()


SIDES = {"h2d": ("pinned", "cuda"), "d2h": ("cuda", "pinned"), "d2d": ("cuda", "cuda"),
         "h2d_pageable": ("pageable", "cuda"), "d2h_pageable": ("cuda", "pageable")}


def make(direction, layers=3, num_blocks=64, block_bytes=2048, rows=40, seed=0):
    """uint8 caches [num_blocks, block_bytes]; mapping of random, unique-destination rows."""
    s_where, d_where = SIDES[direction]
    src = [place(random_bytes((num_blocks, block_bytes), seed + i), s_where) for i in range(layers)]
    dst = [place(torch.zeros(num_blocks, block_bytes, dtype=torch.uint8), d_where) for _ in range(layers)]
    g = torch.Generator().manual_seed(seed + 1000)
    mapping = torch.stack([torch.randperm(num_blocks, generator=g)[:rows],
                           torch.randperm(num_blocks, generator=g)[:rows]], dim=1)
    return src, dst, mapping


def expected_after(src, dst, mapping):
    out = [d.cpu().clone() for d in dst]
    for o, s in zip(out, src):
        o[mapping[:, 1]] = s.cpu()[mapping[:, 0]]
    return out


def assert_equal(dst, expected):
    for i, (d, e) in enumerate(zip(dst, expected)):
        got = d.cpu()
        if not torch.equal(got, e):
            bad = (got != e).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
            raise AssertionError(f"layer {i}: blocks {bad[:20]} differ from the reference")


def on_stream(kind, fn):
    if kind == "default":
        stream = torch.cuda.default_stream(DEV)
    else:
        stream = torch.cuda.Stream(DEV)
        stream.wait_stream(torch.cuda.current_stream(DEV))  # sources were written there
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()


# ---------------------------------------------------------------------------------------
# Eager


@pytest.mark.parametrize("stream_kind", ["default", "side"])
@pytest.mark.parametrize("mode", ["auto", "kernel", "dma"])
@pytest.mark.parametrize("direction", sorted(SIDES))
def test_matches_reference(direction, mode, stream_kind, policy):
    policy(mode)
    src, dst, mapping = make(direction, seed=3)
    expected = expected_after(src, dst, mapping)
    on_stream(stream_kind, lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    assert_equal(dst, expected)


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_mixed_plan_kernel_and_dma_in_one_call(direction, policy):
    # Runs of 8 adjacent 64 KiB blocks (512 KiB: DMA) next to single blocks (kernel).
    policy("auto", dma_min_bytes=256 * 1024, dma_min_bytes_d2d=256 * 1024)
    src, dst, _ = make(direction, layers=2, num_blocks=64, block_bytes=64 * 1024, rows=0)
    mapping = torch.tensor([[k, 40 + k] for k in range(8)] + [[20, 3], [33, 17], [9, 60]])
    plan = _C._plan_cuda_copy(*ptr_args(src[0], dst[0], mapping), device_to_device=direction == "d2d")
    assert plan["paths"] == ["dma", "kernel", "kernel", "kernel"]  # the planner this call runs
    expected = expected_after(src, dst, mapping)
    on_stream("side", lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    assert_equal(dst, expected)


@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_one_big_descriptor_forced_through_the_kernel(direction, policy):
    # 1 MiB + 3 bytes: cut into 16 KiB items plus a ragged one, tiny grid (grid stride).
    policy("kernel", max_ctas=2)
    size = (1 << 20) + 3
    src, dst, _ = make(direction, layers=1, num_blocks=3, block_bytes=size, rows=0, seed=5)
    mapping = torch.tensor([[0, 2], [2, 0]])
    expected = expected_after(src, dst, mapping)
    on_stream("default", lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    assert_equal(dst, expected)


@pytest.mark.parametrize("block_bytes", [1, 3, 10, 21, 100, 1000, 2050, 16 * 1024 + 7])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_odd_block_sizes(direction, block_bytes, policy):
    policy("kernel")
    src, dst, mapping = make(direction, layers=2, num_blocks=24, block_bytes=block_bytes, rows=17,
                             seed=block_bytes)
    expected = expected_after(src, dst, mapping)
    on_stream("side", lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    assert_equal(dst, expected)


def unaligned_view(buffer_where, num_blocks, block_bytes, offset, seed):
    """[num_blocks, block_bytes] uint8 view starting `offset` bytes into an allocation
    (plus the allocation, which must stay alive)."""
    base = place(random_bytes((num_blocks * block_bytes + 64,), seed), buffer_where)
    return base[offset:offset + num_blocks * block_bytes].view(num_blocks, block_bytes), base


@pytest.mark.parametrize("offsets", [(1, 1), (3, 7), (8, 0), (4, 12), (2, 6), (0, 5)])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_unaligned_views(direction, offsets, policy):
    # Same misalignment on both sides (vector body after a byte head) and different
    # misalignments (narrower vectors, down to bytes); block size not a multiple of 16.
    policy("kernel")
    s_where, d_where = SIDES[direction]
    s, s_base = unaligned_view(s_where, 32, 1000, offsets[0], seed=1)
    d, d_base = unaligned_view(d_where, 32, 1000, offsets[1], seed=2)
    d_before = d.cpu().clone()
    base_before = d_base.cpu().clone()
    mapping = torch.tensor([[5, 0], [6, 1], [31, 7], [0, 30], [17, 16]])
    expected = expected_after([s], [d], mapping)
    on_stream("side", lambda: torch_kvops.swap_blocks_batch([s], [d], mapping))
    assert_equal([d], expected)
    # Bytes of the allocation around the view are untouched.
    whole, lo, hi = d_base.cpu(), offsets[1], offsets[1] + d.numel()
    assert torch.equal(whole[:lo], base_before[:lo]) and torch.equal(whole[hi:], base_before[hi:])
    assert not torch.equal(expected[0], d_before)  # the copy had something to change


@pytest.mark.parametrize("direction", ["h2d_pageable", "d2h_pageable"])
def test_pageable_host_memory_goes_to_dma_even_when_kernel_is_forced(direction, policy):
    policy("kernel")
    src, dst, mapping = make(direction, layers=2, rows=30, seed=11)
    expected = expected_after(src, dst, mapping)
    on_stream("default", lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    torch.cuda.synchronize()  # a kernel touching pageable memory would fault here
    assert_equal(dst, expected)


@pytest.mark.parametrize("stream_kind", ["default", "side"])
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_100k_descriptors(direction, stream_kind, policy):
    # 4 layers x 25000 scattered 64-byte blocks = 100k descriptors: one launch over an
    # uploaded descriptor table.
    policy("auto")
    src, dst, mapping = make(direction, layers=4, num_blocks=50_000, block_bytes=64, rows=25_000,
                             seed=13)
    plan = _C._plan_cuda_copy(*ptr_args(src[0], dst[0], mapping))
    assert len(plan["descs"]) > 24_900  # random rows: almost nothing merges
    assert [l["by_value"] for l in plan["launches"]] == [False]
    expected = expected_after(src, dst, mapping)
    on_stream(stream_kind, lambda: torch_kvops.swap_blocks_batch(src, dst, mapping))
    assert_equal(dst, expected)


def test_many_uploads_in_flight_do_not_overwrite_each_other(cycles_per_ms, policy):
    # 20 eager calls, each with its own descriptor table (> one by-value launch), queued
    # behind a 200 ms kernel: the pinned upload slots (8) are reused while earlier
    # uploads may not have run yet; each call must still copy its own mapping.
    policy("kernel")
    calls = []
    for k in range(20):
        src, dst, mapping = make("d2d", layers=1, num_blocks=4000, block_bytes=32, rows=2000,
                                 seed=100 + k)
        calls.append((src, dst, mapping, expected_after(src, dst, mapping)))
    stream = torch.cuda.Stream(DEV)
    stream.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(cycles_per_ms * 200))
        for src, dst, mapping, _ in calls:
            torch_kvops.swap_blocks_batch(src, dst, mapping)
    stream.synchronize()
    for src, dst, mapping, expected in calls:
        assert_equal(dst, expected)


def test_kernel_reads_source_in_stream_order(cycles_per_ms, policy):
    policy("kernel")
    src = torch.zeros(16, 4096, device=DEV)
    dst = torch.zeros(16, 4096).pin_memory()
    mapping = torch.tensor([[k, 15 - k] for k in range(16)])
    stream = torch.cuda.Stream(DEV)
    stream.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(cycles_per_ms * 50))
        src.fill_(3.0)
        torch_kvops.swap_blocks_batch([src], [dst], mapping)
    stream.synchronize()
    assert torch.all(dst == 3.0)


@pytest.mark.parametrize("mode", ["kernel", "auto"])
def test_bad_input_raises_and_leaves_dst_untouched(mode, policy):
    policy(mode)
    src, dst, _ = make("h2d", layers=2, num_blocks=8, rows=0)
    for bad, message in [
        (torch.tensor([[0, 1], [9, 2]]), "out of range"),
        (torch.tensor([[0, 1], [2, 1]]), "named twice"),
        (torch.tensor([[0, 1]], dtype=torch.int32), "must be int64"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            torch_kvops.swap_blocks_batch(src, dst, bad)
    with pytest.raises(RuntimeError, match="bytes per block differ"):
        torch_kvops.swap_blocks_batch(src, [dst[0], torch.zeros(8, 7, dtype=torch.uint8, device=DEV)],
                                      torch.tensor([[0, 1]]))
    torch.cuda.synchronize()
    assert all(torch.count_nonzero(d) == 0 for d in dst)


# ---------------------------------------------------------------------------------------
# .ptrs


def ptr_args(s, d, mapping):
    sb = s.stride(0) * s.element_size()
    db = d.stride(0) * d.element_size()
    block = s[0].numel() * s.element_size()
    sp = s.data_ptr() + mapping[:, 0] * sb
    dp = d.data_ptr() + mapping[:, 1] * db
    return sp, dp, torch.full_like(sp, block)


@pytest.mark.parametrize("mode", ["auto", "kernel", "dma"])
@pytest.mark.parametrize("direction", sorted(SIDES))
def test_ptrs_every_direction_and_mode(direction, mode, policy):
    policy(mode)
    src, dst, mapping = make(direction, layers=1, block_bytes=1000, seed=17)
    expected = expected_after(src, dst, mapping)
    on_stream("side", lambda: torch_kvops.swap_blocks_batch_ptrs(*ptr_args(src[0], dst[0], mapping)))
    assert_equal(dst, expected)


# ---------------------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.parametrize("rows", [40, 3000])  # one by-value launch; several (> 1360 items)
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_captured_kernel_copies_new_bytes_on_each_of_5_replays(direction, rows, policy):
    policy("kernel")
    src, dst, mapping = make(direction, layers=2, num_blocks=4000, block_bytes=96, rows=rows, seed=23)
    if rows > K["items_by_value_large"]:
        plan = _C._plan_cuda_copy(*ptr_args(src[0], dst[0], mapping), capturing=True)
        assert len(plan["launches"]) >= 2 and all(l["by_value"] for l in plan["launches"])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch_kvops.swap_blocks_batch(src, dst, mapping)
    torch.cuda.synchronize()
    assert all(torch.count_nonzero(d) == 0 for d in dst), "capture must not copy"
    for replay in range(5):
        for i, s in enumerate(src):
            s.copy_(random_bytes(tuple(s.shape), 1000 * replay + i))
        for d in dst:
            d.zero_()
        torch.cuda.synchronize()
        expected = expected_after(src, dst, mapping)
        g.replay()
        torch.cuda.synchronize()
        assert_equal(dst, expected)


@pytest.mark.parametrize("mode", ["auto", "dma"])
def test_captured_mixed_and_dma_copies_replay(mode, policy):
    # DMA share under capture: per-copy memcpy nodes (the batch API cannot be captured).
    policy(mode, dma_min_bytes=256 * 1024)
    src, dst, _ = make("h2d", layers=1, num_blocks=64, block_bytes=64 * 1024, rows=0, seed=29)
    mapping = torch.tensor([[k, 32 + k] for k in range(8)] + [[20, 3], [13, 17]])
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        torch_kvops.swap_blocks_batch(src, dst, mapping)
    for replay in range(5):
        src[0].copy_(random_bytes(tuple(src[0].shape), 77 + replay))
        dst[0].zero_()
        torch.cuda.synchronize()
        expected = expected_after(src, dst, mapping)
        g.replay()
        torch.cuda.synchronize()
        assert_equal(dst, expected)


def test_captured_ptrs_kernel_replays(policy):
    policy("kernel")
    src, dst, mapping = make("d2h", layers=1, block_bytes=2048, seed=31)
    args = ptr_args(src[0], dst[0], mapping)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch_kvops.swap_blocks_batch_ptrs(*args)
    for replay in range(5):
        src[0].copy_(random_bytes(tuple(src[0].shape), 300 + replay))
        dst[0].zero_()
        torch.cuda.synchronize()
        expected = expected_after(src, dst, mapping)
        g.replay()
        torch.cuda.synchronize()
        assert_equal(dst, expected)


# ---------------------------------------------------------------------------------------
# Benchmark baselines (the benchmark's own correctness check runs them on real sizes)


@pytest.mark.parametrize("name", ["_bench_memcpy_loop", "_bench_memcpy_batch"])
def test_bench_baselines_copy_the_same_bytes(name):
    src, dst, mapping = make("h2d", layers=1, block_bytes=2048, seed=37)
    expected = expected_after(src, dst, mapping)
    stream = torch.cuda.Stream(DEV)
    with torch.cuda.stream(stream):
        seconds = getattr(_C, name)(*ptr_args(src[0], dst[0], mapping))
    stream.synchronize()
    assert seconds >= 0.0
    assert_equal(dst, expected)
