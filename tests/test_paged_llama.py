"""PagedLlama (torch_kvops.testing.paged_llama): the paged forward against a dense
reference, chunked prefill, disaggregated prefill/decode giving identical tokens, and
torch.compile(fullgraph=True) with a KV hook."""
import pytest
import torch
import torch._dynamo

from torch_kvops import LayerEvents
from torch_kvops.testing.paged_llama import (
    BlockAllocator,
    LlamaConfig,
    PagedLlama,
    decode_batch,
    decode_from_cache,
    generate,
    prefill,
    prefill_batch,
    reference_forward,
    tiny_config,
)

pytestmark = [pytest.mark.unit]


def _prompt(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model():
    return PagedLlama(tiny_config())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The models here are tiny: with 2 intra-op threads on a loaded 2-core box every
    # small matmul pays thread wake-up/contention (~30x slower). Restore afterwards.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_config_and_cache_layout(model):
    cfg = model.cfg
    caches = model.allocate_kv_caches(7)
    assert len(caches) == cfg.num_layers
    for c in caches:
        assert c.shape == (7, 2, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        assert c.is_contiguous() and c.dtype == cfg.dtype
    # deterministic weights from the seed, different for another seed
    again, other = PagedLlama(tiny_config()), PagedLlama(tiny_config(seed=1))
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n
    assert any(not torch.equal(a, c) for a, c in zip(model.state_dict().values(),
                                                     other.state_dict().values()))
    assert not torch.equal(model.layers[0].qkv_proj.weight, other.layers[0].qkv_proj.weight)


def test_block_allocator():
    al = BlockAllocator(5)
    a = al.allocate(3)
    assert sorted(a) == a and len(set(a)) == 3 and al.num_free == 2
    with pytest.raises(RuntimeError):
        al.allocate(3)
    al.free(a[:2])
    b = al.allocate(4)
    assert len(set(a[2:] + b)) == 5
    with pytest.raises(ValueError):
        al.free([a[2], a[2]])


def test_prefill_batch_slots_and_positions():
    ids, pos, batch = prefill_batch([[5, 6, 7], [8, 9]], [[3, 1], [0]], [3, 0], block_size=4)
    assert ids.tolist() == [5, 6, 7, 8, 9]
    assert pos.tolist() == [3, 4, 5, 0, 1]
    # position 3 -> block 3 offset 3; 4, 5 -> block 1 offsets 0, 1; request 2 in block 0
    assert batch.slot_mapping.tolist() == [15, 4, 5, 0, 1]
    assert batch.num_new_tokens == [3, 2] and batch.context_lens == [6, 2]
    ids, pos, batch = decode_batch([11, 12], [6, 2], [[3, 1], [0]], block_size=4)
    assert pos.tolist() == [5, 1] and batch.slot_mapping.tolist() == [5, 1]
    with pytest.raises(ValueError):
        prefill_batch([[1] * 9], [[0, 1]], block_size=4)  # 2 blocks of 4 < 9 tokens


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_paged_forward_matches_dense_reference(batch_invariant):
    m = PagedLlama(tiny_config(batch_invariant=batch_invariant))
    bs = m.cfg.block_size
    p1, p2 = _prompt(23, 1), _prompt(9, 2)       # 23 tokens span 6 blocks of 4
    ref1, ref2 = reference_forward(m, p1), reference_forward(m, p2)
    caches = m.allocate_kv_caches(32)
    # non-contiguous, out-of-order block tables, interleaved between the requests
    bt1, bt2 = [17, 3, 29, 8, 0, 21], [5, 30, 12]
    # prefill the first 15 / 6 tokens together, then decode the rest one token per step
    ids, pos, batch = prefill_batch([p1[:15], p2[:6]], [bt1, bt2], block_size=bs)
    logits = m(ids, pos, caches, batch)
    torch.testing.assert_close(logits, torch.stack([ref1[14], ref2[5]]), rtol=1e-4, atol=1e-4)
    for step in range(8):
        n1 = 16 + step
        reqs = [(p1, bt1, n1, ref1)] + ([(p2, bt2, 7 + step, ref2)] if 7 + step <= 9 else [])
        ids, pos, batch = decode_batch([p[n - 1] for p, _, n, _ in reqs], [n for *_, n, _ in reqs],
                                       [bt for _, bt, _, _ in reqs], block_size=bs)
        logits = m(ids, pos, caches, batch)
        want = torch.stack([r[n - 1] for *_, n, r in reqs])
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # the cache holds the reference K of layer 0 at the right slots: recompute it
    layer = m.layers[0]
    h = m.embed(torch.tensor(p1))
    k = layer.qkv_proj(layer.input_norm(h))[:, layer.q_size:layer.q_size + layer.kv_size]
    k = k.reshape(23, m.cfg.num_kv_heads, m.cfg.head_dim)
    half = m.cfg.head_dim // 2
    ang = torch.arange(23.0)[:, None, None] * 10000.0 ** (-torch.arange(half) / half)
    k1, k2 = k[..., :half], k[..., half:]
    k = torch.cat((k1 * ang.cos() - k2 * ang.sin(), k2 * ang.cos() + k1 * ang.sin()), -1)
    got = torch.stack([caches[0][bt1[p // bs], 0, p % bs] for p in range(23)])
    torch.testing.assert_close(got, k, rtol=1e-5, atol=1e-5)
    # blocks no request used are still zero
    used = set(bt1) | set(bt2)
    for b in range(32):
        if b not in used:
            assert torch.count_nonzero(caches[1][b]) == 0


def test_chunked_prefill_matches_one_shot(model):
    bs = model.cfg.block_size
    p = _prompt(27, 3)
    one, two = model.allocate_kv_caches(16), model.allocate_kv_caches(16)
    bt = [9, 2, 14, 5, 11, 0, 7]
    ids, pos, batch = prefill_batch([p], [bt], block_size=bs)
    want = model(ids, pos, one, batch)
    # chunk boundary inside a block: 10 tokens, then 17 attending to the first 10
    ids, pos, batch = prefill_batch([p[:10]], [bt], block_size=bs)
    model(ids, pos, two, batch)
    ids, pos, batch = prefill_batch([p[10:]], [bt], [10], block_size=bs)
    got = model(ids, pos, two, batch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # and the chunked second step is really reading the first chunk's KV
    wiped = [c.clone() for c in two]
    for c in wiped:
        c[bt[0]] = 0
    ids, pos, batch = prefill_batch([p[10:]], [bt], [10], block_size=bs)
    assert not torch.allclose(model(ids, pos, wiped, batch), want, rtol=1e-3, atol=1e-3)


def test_greedy_continuations_differ_between_prompts():
    m = PagedLlama(LlamaConfig(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=1,
                               intermediate_size=704))
    caches, al = m.allocate_kv_caches(64), BlockAllocator(64)
    prompts = [_prompt(n, 10 + n, m.cfg.vocab_size) for n in (3, 20, 50)]
    outs = generate(m, prompts, 16, caches, al)
    assert al.num_free == 64
    assert all(len(o) == 16 for o in outs)
    assert len({tuple(o) for o in outs}) == 3
    assert all(len(set(o)) >= 4 for o in outs), outs  # not one token repeated
    # every generated token is the dense reference's greedy choice
    for p, o in zip(prompts, outs):
        ref = reference_forward(m, p + o[:-1])
        assert ref[len(p) - 1:].argmax(-1).tolist() == o


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_disaggregated_prefill_decode_gives_identical_tokens(model, chunk_size):
    prompts = [_prompt(n, 20 + n) for n in (13, 5, 22)]
    max_new = 12

    mono_caches, mono_al = model.allocate_kv_caches(40), BlockAllocator(40)
    mono = generate(model, prompts, max_new, mono_caches, mono_al, chunk_size=chunk_size)
    assert mono_al.num_free == 40

    # prefill side: its own cache and block ids, one prefill pass
    p_caches, p_al = model.allocate_kv_caches(24), BlockAllocator(24)
    p_al.allocate(3)  # shift the ids
    p_tables = [[] for _ in prompts]
    first = prefill(model, prompts, p_caches, p_tables, chunk_size, p_al)

    # decode side: other block ids (reversed order of allocation), KV copied block-wise
    d_caches, d_al = model.allocate_kv_caches(64), BlockAllocator(64)
    d_tables = []
    for pt in p_tables:
        dt = list(reversed(d_al.allocate(len(pt) + 1)))
        d_tables.append(dt[:len(pt)])
    src = torch.tensor([b for pt in p_tables for b in pt])
    dst = torch.tensor([b for dt in d_tables for b in dt])
    for s, d in zip(p_caches, d_caches):
        d[dst] = s[src]
    assert dst.tolist() != src.tolist()

    # all requests in one decode batch
    got = decode_from_cache(model, prompts, first, [list(t) for t in d_tables], d_caches,
                            max_new, allocator=d_al)
    assert got == mono
    # batch invariance: each request decoded alone, in another order, gives the same
    for i in reversed(range(len(prompts))):
        alone = decode_from_cache(model, [prompts[i]], [first[i]], [list(d_tables[i])],
                                  d_caches, max_new, allocator=d_al)
        assert alone == [mono[i]]

    # losing the prompt's KV changes the continuation (the test can fail)
    for c in d_caches:
        c[dst] = 0
    broken = decode_from_cache(model, prompts, first, [list(t) for t in d_tables], d_caches,
                               max_new, allocator=d_al)
    assert broken != mono


def test_kv_hook_runs_after_the_layer_write_and_before_attention(model):
    bs = model.cfg.block_size
    caches = model.allocate_kv_caches(16)
    ids, pos, batch = prefill_batch([_prompt(10, 7)], [[6, 2, 9]], block_size=bs)
    want = model(ids, pos, model.allocate_kv_caches(16), batch)
    seen = []

    def hook(layer_idx, kv_cache):
        assert kv_cache is caches[layer_idx]
        seen.append((layer_idx, kv_cache[[6, 2, 9]].clone()))

    model.kv_hook = hook
    try:
        torch.testing.assert_close(model(ids, pos, caches, batch), want, rtol=0, atol=0)
        assert [layer for layer, _ in seen] == list(range(model.cfg.num_layers))
        for layer, snap in seen:  # the new KV was already in the cache
            assert torch.equal(snap, caches[layer][[6, 2, 9]])
            assert torch.count_nonzero(snap[2, :, 2:]) == 0  # beyond token 10: untouched

        # a hook that clobbers the new KV changes this layer's attention output
        def clobber(layer_idx, kv_cache):
            kv_cache[[6, 2, 9]] = 0.0

        model.kv_hook = clobber
        assert not torch.allclose(model(ids, pos, caches, batch), want, rtol=1e-3, atol=1e-3)
    finally:
        model.kv_hook = None


SCRATCH = 31  # a block no request uses; the hook marks it


class _ConnectorLikeHook:
    """Stands in for the connector: a method that only issues torch ops on the layer's
    cache tensor with Python-int constants: an in-place fill of a scratch block, then
    the kvops event ops."""

    def __init__(self, events):
        self.handle = events.handle
        self.tag = 100

    def hook(self, layer_idx, kv_cache):
        kv_cache.index_fill_(0, torch.tensor([SCRATCH]), float(self.tag + layer_idx))
        torch.ops.kvops.record_layer_event(kv_cache, self.handle, layer_idx)
        torch.ops.kvops.push_layer(kv_cache, self.handle, layer_idx)


def _steps(bs):
    p1, p2 = _prompt(11, 5), _prompt(6, 6)
    bt1, bt2 = [4, 9, 1], [7, 2]
    return [
        prefill_batch([p1[:7], p2[:4]], [bt1, bt2], block_size=bs),          # prefill
        prefill_batch([p1[7:], p2[4:]], [bt1, bt2], [7, 4], block_size=bs),  # 2nd chunk
        decode_batch([3, 4], [12, 7], [bt1, bt2], block_size=bs),             # decode
        decode_batch([5], [13], [bt1 + [6]], block_size=bs),                  # new block
    ]


def test_compiled_forward_has_no_graph_breaks(model):
    m = PagedLlama(model.cfg)
    m.load_state_dict(model.state_dict())
    caches = m.allocate_kv_caches(32)
    with LayerEvents(m.cfg.num_layers) as events:
        m.kv_hook = _ConnectorLikeHook(events).hook
        for ids, pos, batch in _steps(m.cfg.block_size):
            explanation = torch._dynamo.explain(m)(ids, pos, caches, batch)
            assert explanation.graph_break_count == 0, explanation.break_reasons
            assert explanation.graph_count == 1
    # and with no hook
    m.kv_hook = None
    ids, pos, batch = _steps(m.cfg.block_size)[0]
    assert torch._dynamo.explain(m)(ids, pos, caches, batch).graph_break_count == 0


def test_compiled_forward_matches_eager_with_hook(model):
    from torch._dynamo.utils import counters

    counters.clear()
    L = model.cfg.num_layers
    eager_caches, comp_caches = model.allocate_kv_caches(32), model.allocate_kv_caches(32)
    compiled = torch.compile(model, fullgraph=True)
    ids, pos, batch = _steps(model.cfg.block_size)[0]  # one inductor compile keeps it fast
    try:
        with LayerEvents(L) as eager_events, LayerEvents(L) as events:
            model.kv_hook = _ConnectorLikeHook(eager_events).hook
            want = model(ids, pos, eager_caches, batch)
            # the ops reject any tensor but the bound cache: the compiled graph must
            # write the real cache in place before the hook, not a temporary copy
            for layer, cache in enumerate(comp_caches):
                events.bind(layer, cache)
            model.kv_hook = _ConnectorLikeHook(events).hook
            got = compiled(ids, pos, comp_caches, batch)
            assert [events.next_ready(1.0) for _ in range(L)] == list(range(L))
            assert events.next_ready(0.01) is None
    finally:
        model.kv_hook = None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for layer, (e, c) in enumerate(zip(eager_caches, comp_caches)):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
        assert torch.all(c[SCRATCH] == 100 + layer)  # the hook ran inside the graph
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
