"""kvops ops on the CPU: opcheck, reference equivalence, validation, torch.compile."""
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_kvops  # noqa: F401  registers torch.ops.kvops
from torch_kvops import LayerEvents

pytestmark = [pytest.mark.unit]


def make_layers(num_layers, num_blocks, block_shape, dtype=torch.float32, fill=True):
    def one():
        if dtype.is_floating_point:
            return torch.randn(num_blocks, *block_shape).to(dtype) if fill else torch.zeros(num_blocks, *block_shape, dtype=dtype)
        return torch.randint(-100, 100, (num_blocks, *block_shape), dtype=dtype) if fill else torch.zeros(num_blocks, *block_shape, dtype=dtype)
    return [one() for _ in range(num_layers)]


def reference_swap(src, dst, mapping):
    out = [d.clone() for d in dst]
    for s, d in mapping.tolist():
        for i in range(len(src)):
            out[i][d] = src[i][s]
    return out


# ---------------------------------------------------------------- opcheck


def test_opcheck_swap_blocks_batch():
    src = make_layers(3, 10, (2, 4, 8))
    dst = make_layers(3, 12, (2, 4, 8), fill=False)
    mapping = torch.tensor([[0, 3], [1, 4], [7, 0]], dtype=torch.int64)
    torch.library.opcheck(torch.ops.kvops.swap_blocks_batch.default, (src, dst, mapping))


def test_opcheck_swap_blocks_batch_ptrs():
    a = torch.randn(64)
    b = torch.zeros(64)
    ptrs = lambda t, off: t.data_ptr() + off * t.element_size()
    src_ptrs = torch.tensor([ptrs(a, 0), ptrs(a, 32)])
    dst_ptrs = torch.tensor([ptrs(b, 16), ptrs(b, 48)])
    sizes = torch.tensor([16 * 4, 8 * 4])
    torch.library.opcheck(torch.ops.kvops.swap_blocks_batch.ptrs, (src_ptrs, dst_ptrs, sizes))
    assert torch.equal(b[16:32], a[0:16]) and torch.equal(b[48:56], a[32:40])


@pytest.mark.parametrize("op", ["record_layer_event", "push_layer"])
def test_opcheck_event_ops(op):
    with LayerEvents(4) as events:
        kv = torch.randn(8, 16)
        torch.library.opcheck(getattr(torch.ops.kvops, op).default, (kv, events.handle, 2))


def test_every_op_has_a_docstring():
    for packet in ("swap_blocks_batch", "record_layer_event", "push_layer"):
        assert "layer" in (getattr(torch.ops.kvops, packet).__doc__ or "")
    assert "address" in torch.ops.kvops.swap_blocks_batch.ptrs.__doc__


# ---------------------------------------------------------------- semantics

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64]


@st.composite
def swap_cases(draw):
    num_layers = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(DTYPES))
    block_shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    n_src = draw(st.integers(1, 24))
    n_dst = draw(st.integers(1, 24))
    rows = draw(st.integers(0, min(n_src, n_dst)))
    dst_ids = draw(st.permutations(range(n_dst)))[:rows]
    if draw(st.booleans()):  # runs of consecutive blocks, which the planner merges
        start_s = draw(st.integers(0, n_src - rows))
        start_d = draw(st.integers(0, n_dst - rows))
        pairs = [(start_s + k, start_d + k) for k in range(rows)]
    else:
        pairs = [(draw(st.integers(0, n_src - 1)), d) for d in dst_ids]
    return num_layers, dtype, block_shape, n_src, n_dst, pairs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(swap_cases())
def test_swap_blocks_batch_matches_reference(case):
    num_layers, dtype, block_shape, n_src, n_dst, pairs = case
    src = make_layers(num_layers, n_src, block_shape, dtype)
    dst = make_layers(num_layers, n_dst, block_shape, dtype)
    mapping = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    expected = reference_swap(src, dst, mapping)
    torch.ops.kvops.swap_blocks_batch(src, dst, mapping)
    for got, want in zip(dst, expected):
        assert torch.equal(got, want)


def test_swap_blocks_batch_strided_block_dim_and_views():
    # dim 0 strided (a cache that is a slice of a larger buffer) is fine as long as each
    # block is contiguous.
    big = torch.randn(20, 3, 8)
    src = [big[::2]]
    dst = [torch.zeros(6, 3, 8)]
    mapping = torch.tensor([[1, 0], [2, 1], [9, 5]])
    expected = reference_swap(src, dst, mapping)
    torch.ops.kvops.swap_blocks_batch(src, dst, mapping)
    assert torch.equal(dst[0], expected[0])


def test_swap_blocks_batch_large_parallel_copy():
    # Above the parallel threshold: exercises the chunked multi-thread path.
    src = make_layers(4, 64, (64, 128))  # 32 KiB blocks, 8 MiB per layer
    dst = make_layers(4, 64, (64, 128), fill=False)
    perm = torch.randperm(64)
    mapping = torch.stack([torch.arange(64), perm], dim=1)
    torch.ops.kvops.swap_blocks_batch(src, dst, mapping)
    for s, d in zip(src, dst):
        assert torch.equal(d[perm], s)


def test_swap_blocks_batch_empty_mapping_is_noop():
    src, dst = make_layers(2, 4, (3,)), make_layers(2, 4, (3,))
    before = [d.clone() for d in dst]
    torch.ops.kvops.swap_blocks_batch(src, dst, torch.empty(0, 2, dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


def test_swap_blocks_batch_within_one_cache():
    cache = torch.randn(8, 4)
    expected = cache.clone()
    expected[[5, 6]] = cache[[0, 1]]
    torch.ops.kvops.swap_blocks_batch([cache], [cache], torch.tensor([[0, 5], [1, 6]]))
    assert torch.equal(cache, expected)


# ---------------------------------------------------------------- validation

def _bad_cases():
    f32 = lambda *s: torch.randn(*s)
    ok_map = torch.tensor([[0, 1]])
    return {
        "list lengths": ([f32(4, 2)], [f32(4, 2), f32(4, 2)], ok_map, "src has 1 tensors but dst has 2"),
        "mapping dtype": ([f32(4, 2)], [f32(4, 2)], ok_map.int(), "must be int64"),
        "mapping shape": ([f32(4, 2)], [f32(4, 2)], torch.tensor([0, 1]), "shape [N, 2]"),
        "mapping shape 3 cols": ([f32(4, 2)], [f32(4, 2)], torch.tensor([[0, 1, 2]]), "shape [N, 2]"),
        "src index out of range": ([f32(4, 2)], [f32(4, 2)], torch.tensor([[0, 1], [4, 2]]), "source block 4 is out of range"),
        "negative src": ([f32(4, 2)], [f32(4, 2)], torch.tensor([[0, 1], [-1, 2]]), "source block -1 is out of range"),
        "dst index out of range": ([f32(4, 2)], [f32(4, 2)], torch.tensor([[0, 1], [1, 9]]), "destination block 9 is out of range"),
        "negative dst": ([f32(4, 2)], [f32(4, 2)], torch.tensor([[0, 1], [1, -3]]), "destination block -3 is out of range"),
        "out of range in a later layer": ([f32(8, 2), f32(8, 2)], [f32(8, 2), f32(4, 2)], torch.tensor([[0, 1], [1, 6]]), "dst[1] with 4 blocks"),
        "duplicate destination": ([f32(4, 2)], [f32(4, 2)], torch.tensor([[0, 1], [2, 3], [3, 1]]), "destination block 1 is named twice"),
        "dtype mismatch": ([f32(4, 2)], [torch.zeros(4, 2, dtype=torch.float16)], ok_map, "dtype mismatch at layer 0"),
        "bytes per block": ([f32(4, 2)], [f32(4, 3)], ok_map, "bytes per block differ at layer 0"),
        "non-contiguous blocks": ([f32(4, 2, 3).transpose(1, 2)], [f32(4, 3, 2)], ok_map, "blocks of src[0] are not contiguous"),
        "non-contiguous dst blocks": ([f32(4, 6)], [f32(4, 12)[:, ::2]], ok_map, "blocks of dst[0] are not contiguous"),
        "in-place read/write overlap": (None, None, torch.tensor([[0, 1], [1, 2]]), "both a source"),
    }


@pytest.mark.parametrize("name", list(_bad_cases()))
def test_bad_input_raises_and_leaves_dst_unchanged(name):
    src, dst, mapping, message = _bad_cases()[name]
    if src is None:  # same cache as source and destination
        cache = torch.randn(4, 2)
        src = dst = [cache]
    before = [d.clone() for d in dst]
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        torch.ops.kvops.swap_blocks_batch(src, dst, mapping)
    for d, b in zip(dst, before):
        assert torch.equal(d, b), "a rejected call must not change any destination byte"


def _cpu_kernel(*args):
    # Only one real device exists here, so mixed-device lists are built with a meta
    # tensor and sent straight to the CPU kernel (the dispatcher would pick Meta).
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    return torch.ops.kvops.swap_blocks_batch.default.redispatch(keys, *args)


def test_mixed_devices_within_dst_rejected():
    dst = [torch.zeros(4, 2), torch.empty(4, 2, device="meta")]
    with pytest.raises(RuntimeError, match=r"dst\[1\] is on meta but dst\[0\] is on cpu"):
        _cpu_kernel([torch.randn(4, 2), torch.randn(4, 2)], dst, torch.tensor([[0, 1]]))
    assert torch.equal(dst[0], torch.zeros(4, 2))


def test_unsupported_device_pair_rejected():
    with pytest.raises(RuntimeError, match="unsupported device pair cpu -> meta"):
        _cpu_kernel([torch.randn(4, 2)], [torch.empty(4, 2, device="meta")], torch.tensor([[0, 1]]))


def test_mapping_on_wrong_device_rejected():
    with pytest.raises(RuntimeError, match="block_mapping must be on the CPU"):
        _cpu_kernel([torch.randn(4, 2)], [torch.zeros(4, 2)], torch.tensor([[0, 1]], device="meta"))


@pytest.mark.parametrize("bad, message", [
    (lambda: (torch.tensor([1]), torch.tensor([2, 3]), torch.tensor([4])), "equal lengths"),
    (lambda: (torch.tensor([1], dtype=torch.int32), torch.tensor([2]), torch.tensor([4])), "src_ptrs must be int64"),
    (lambda: (torch.tensor([[1]]), torch.tensor([2]), torch.tensor([4])), "src_ptrs must be 1-D"),
    (lambda: (torch.tensor([1]), torch.tensor([2]), torch.tensor([-4])), "is negative"),
    (lambda: (torch.tensor([0]), torch.tensor([2]), torch.tensor([4])), "null address"),
])
def test_ptrs_overload_validates_what_it_can(bad, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kvops.swap_blocks_batch.ptrs(*bad())


# ---------------------------------------------------------------- LayerEvents

def test_layer_events_queue_order_and_wait():
    kv = torch.zeros(4, 4)
    with LayerEvents(3) as events:
        for layer in (2, 0, 1):
            torch.ops.kvops.record_layer_event(kv, events.handle, layer)
            torch.ops.kvops.push_layer(kv, events.handle, layer)
        assert [events.next_ready(1.0) for _ in range(3)] == [2, 0, 1]
        assert events.next_ready(0.01) is None
        assert events.wait(1, timeout=1.0)


def test_layer_events_bad_handle_and_layer():
    kv = torch.zeros(4, 4)
    with LayerEvents(2) as events:
        with pytest.raises(RuntimeError, match="layer 2 is out of range"):
            torch.ops.kvops.record_layer_event(kv, events.handle, 2)
        with pytest.raises(RuntimeError, match="layer -1 is out of range"):
            torch.ops.kvops.push_layer(kv, events.handle, -1)
        with pytest.raises(RuntimeError, match="layer 5 is out of range"):
            events.wait(5, 0.1)
        handle = events.handle
    with pytest.raises(RuntimeError, match="unknown or closed handle"):
        torch.ops.kvops.push_layer(kv, handle, 0)
    with pytest.raises(RuntimeError, match="num_layers"):
        LayerEvents(0)


def test_closed_events_answer_nothing_and_unknown_handles_raise():
    events = LayerEvents(2)
    events.close()
    # A sender racing close() ends quietly ...
    assert events.next_ready(0.01) is None
    assert events.wait(0, 0.01) is False
    # ... while a handle that never existed is a bug worth an error.
    from torch_kvops import _C
    with pytest.raises(RuntimeError, match="unknown handle"):
        _C.layer_events_next_ready(10**9, 0.01)


def test_layer_events_close_wakes_blocked_reader():
    events = LayerEvents(2)
    result = []
    reader = threading.Thread(target=lambda: result.append(events.next_ready(timeout=None)))
    reader.start()
    events.close()
    reader.join(timeout=5)
    assert not reader.is_alive() and result == [None]


def test_next_ready_releases_the_gil():
    # A reader blocked in next_ready must not stop Python from running elsewhere.
    with LayerEvents(1) as events:
        kv = torch.zeros(2)
        threading.Thread(target=events.next_ready, args=(0.5,), daemon=True).start()
        counter = 0
        import time
        end = time.monotonic() + 0.2
        while time.monotonic() < end:
            counter += 1
        assert counter > 1000
        torch.ops.kvops.push_layer(kv, events.handle, 0)


def test_bound_layer_rejects_other_tensor():
    cache, other = torch.zeros(4, 4), torch.zeros(4, 4)
    with LayerEvents(1) as events:
        events.bind(0, cache)
        torch.ops.kvops.record_layer_event(cache, events.handle, 0)
        with pytest.raises(RuntimeError, match="temporary copy"):
            torch.ops.kvops.record_layer_event(other, events.handle, 0)


def test_swap_blocks_batch_blocks_larger_than_a_chunk():
    # 512 KiB blocks: the byte-range split (a few huge blocks spread over threads).
    src = make_layers(2, 6, (128, 1024))
    dst = make_layers(2, 6, (128, 1024), fill=False)
    mapping = torch.tensor([[0, 5], [1, 0], [4, 2]])
    expected = reference_swap(src, dst, mapping)
    torch.ops.kvops.swap_blocks_batch(src, dst, mapping)
    assert all(torch.equal(d, e) for d, e in zip(dst, expected))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_swap_blocks_batch_thread_counts_and_runs(threads):
    # Many small blocks over torch's thread pool, with adjacent runs that each thread
    # merges; layers of different block sizes; 2 MiB in all (above the parallel threshold).
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = [torch.randn(4096, 256), torch.randint(0, 100, (4096, 3), dtype=torch.int8)]
        dst = [torch.zeros(4096, 256), torch.zeros(4096, 3, dtype=torch.int8)]
        runs = torch.stack([torch.arange(100, 1100), torch.arange(2000, 3000)], dim=1)
        scattered = torch.stack([torch.randperm(1000) + 3000, torch.randperm(1000)], dim=1)
        mapping = torch.cat([runs, scattered])
        expected = reference_swap(src, dst, mapping[:50])  # spot check below
        torch.ops.kvops.swap_blocks_batch(src, dst, mapping)
        for s, d in zip(src, dst):
            assert torch.equal(d[mapping[:, 1]], s[mapping[:, 0]])
            untouched = torch.ones(4096, dtype=torch.bool)
            untouched[mapping[:, 1]] = False
            assert torch.count_nonzero(d[untouched]) == 0
        assert torch.equal(dst[0][mapping[:50, 1]], expected[0][mapping[:50, 1]])
    finally:
        torch.set_num_threads(old)
