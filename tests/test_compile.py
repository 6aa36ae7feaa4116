"""The ops inside torch.compile(fullgraph=True): they keep their effect, stay ordered,
never graph-break, and do not recompile when the number of blocks changes."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import torch_kvops  # noqa: F401
from torch_kvops import LayerEvents

pytestmark = [pytest.mark.unit]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_swap_blocks_batch_compiled_copies_and_never_recompiles():
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True)
    def offload(src, dst, mapping):
        torch.ops.kvops.swap_blocks_batch(src, dst, mapping)

    src = [torch.randn(64, 2, 16) for _ in range(3)]
    for n in range(2, 14):  # a different number of blocks every step
        dst = [torch.zeros(64, 2, 16) for _ in range(3)]
        mapping = torch.stack([torch.randperm(64)[:n], torch.randperm(64)[:n]], dim=1)
        torch._dynamo.mark_dynamic(mapping, 0)
        offload(src, dst, mapping)
        for s, d in zip(src, dst):
            assert torch.equal(d[mapping[:, 1]], s[mapping[:, 0]])
            untouched = torch.ones(64, dtype=torch.bool)
            untouched[mapping[:, 1]] = False
            assert torch.count_nonzero(d[untouched]) == 0
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for 12 calls"


def _model_step(kv_caches, slots, new_kv, handle):
    """A model-shaped step: each layer scatters its new KV into the cache in place,
    then records its event and pushes itself, then keeps computing."""
    h = new_kv
    for layer, cache in enumerate(kv_caches):
        cache.index_copy_(0, slots, h)
        torch.ops.kvops.record_layer_event(cache, handle, layer)
        torch.ops.kvops.push_layer(cache, handle, layer)
        h = torch.tanh(h * 1.5 + 0.1)
    return h


def test_event_ops_compiled_deliver_pushes_in_order_on_the_real_cache():
    num_layers = 4
    caches = [torch.zeros(32, 8) for _ in range(num_layers)]
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_model_step, backend=counter, fullgraph=True)
    with LayerEvents(num_layers) as events:
        for layer, cache in enumerate(caches):
            events.bind(layer, cache)  # any temporary copy would now raise
        for step in range(3):
            slots = torch.tensor([step, 10 + step])
            new = torch.randn(2, 8)
            eager_caches = [c.clone() for c in caches]
            expected = _model_step(eager_caches, slots, new, _null_events(num_layers))
            out = compiled(caches, slots, new, events.handle)
            assert [events.next_ready(1.0) for _ in range(num_layers)] == list(range(num_layers))
            assert events.next_ready(0.01) is None
            assert all(events.wait(layer, 1.0) for layer in range(num_layers))
            torch.testing.assert_close(out, expected)
            for got, want in zip(caches, eager_caches):
                torch.testing.assert_close(got, want)  # fused tanh may round differently
    assert counter.frame_count == 1


_NULL = {}


def _null_events(num_layers):
    if num_layers not in _NULL:
        _NULL[num_layers] = LayerEvents(num_layers)
    return _NULL[num_layers].handle


def test_compiled_graph_that_copies_the_cache_is_caught():
    # `cache.add_` is functionalized into a temporary that inductor writes back only at
    # the end of the graph: the layer would be pushed before its bytes are in the cache.
    def bad_step(cache, handle):
        cache.add_(1.0)
        torch.ops.kvops.record_layer_event(cache, handle, 0)
        torch.ops.kvops.push_layer(cache, handle, 0)
        return cache.sum()

    cache = torch.zeros(16, 4)
    with LayerEvents(1) as events:
        events.bind(0, cache)
        with pytest.raises(RuntimeError, match="temporary copy"):
            torch.compile(bad_step, fullgraph=True)(cache, events.handle)


def test_ptrs_overload_is_kept_and_ordered_in_compiled_graph():
    a, b, c = torch.arange(16.0), torch.zeros(16), torch.zeros(16)
    nbytes = torch.tensor([a.numel() * a.element_size()])

    @torch.compile(fullgraph=True)
    def chained(ab_src, ab_dst, bc_src, bc_dst, n):
        # Nothing here names a, b or c: without the effect registration both calls are
        # dead code; with it they run, and in program order (b is filled before read).
        torch.ops.kvops.swap_blocks_batch.ptrs(ab_src, ab_dst, n)
        torch.ops.kvops.swap_blocks_batch.ptrs(bc_src, bc_dst, n)

    chained(torch.tensor([a.data_ptr()]), torch.tensor([b.data_ptr()]),
            torch.tensor([b.data_ptr()]), torch.tensor([c.data_ptr()]), nbytes)
    assert torch.equal(b, a) and torch.equal(c, a)


def test_ptrs_overload_is_not_ordered_after_tensor_mutations():
    # Documented limitation (docs/ops.md): effect tokens order effectful ops among
    # themselves, not against functional tensor writes, so inductor may run the raw
    # copy before an earlier in-place write in the same graph. Observed on torch 2.13:
    # the copy reads the value from before `x.mul_(2)`. If this ever starts failing,
    # torch changed the behaviour and the docs should be updated.
    x, y = torch.ones(16), torch.zeros(16)

    @torch.compile(fullgraph=True)
    def step(x, src, dst, n):
        x.mul_(2)
        torch.ops.kvops.swap_blocks_batch.ptrs(src, dst, n)

    step(x, torch.tensor([x.data_ptr()]), torch.tensor([y.data_ptr()]), torch.tensor([64]))
    assert torch.equal(x, torch.full((16,), 2.0))
    assert torch.equal(y, torch.ones(16)) or torch.equal(y, torch.full((16,), 2.0))
