"""Tensor-parallel head planning (tp.py) without an engine: every prefill/decode TP
combination moves every KV head of every block exactly once per decode rank that
holds it, byte-exact, from a prefill rank that holds it."""
import itertools

import pytest
import torch

from torch_kvops.integrations.vllm.tp import (HeadSlice, check_tp, expected_parts, part_id,
                                              plan_parts, rank_heads, source_rank)

BLOCKS, BLOCK_SIZE, HEAD = 6, 4, 8


def full_cache(kv_heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BLOCKS, kv_heads, BLOCK_SIZE, 2 * HEAD, generator=gen)


@pytest.mark.parametrize("kv_heads,p_tp,d_tp", [
    (k, p, d) for k, p, d in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 4])])
def test_every_head_lands_once_on_every_decode_rank_that_holds_it(kv_heads, p_tp, d_tp):
    full = full_cache(kv_heads)
    # per rank: [blocks, local heads, ...], viewed as units (one head of one block)
    p_caches = [full[:, h.start:h.stop].contiguous() for h in
                (rank_heads(kv_heads, p_tp, r) for r in range(p_tp))]
    d_caches = [torch.full((BLOCKS, len(rank_heads(kv_heads, d_tp, d)), BLOCK_SIZE, 2 * HEAD), -1.0)
                for d in range(d_tp)]
    src_blocks, dst_blocks = [0, 2, 5], [4, 1, 3]
    sent = {}
    for r in range(p_tp):
        for plan in plan_parts(kv_heads, p_tp, r, d_tp):
            src, dst = plan.units(src_blocks, dst_blocks)
            s_units = p_caches[r].view(-1, BLOCK_SIZE, 2 * HEAD)
            d_units = d_caches[plan.decode_rank].view(-1, BLOCK_SIZE, 2 * HEAD)
            d_units[torch.tensor(dst)] = s_units[torch.tensor(src)]
            pid = part_id("T", r, plan.decode_rank)
            assert pid not in sent
            sent[pid] = plan
            for h in range(plan.heads.start, plan.heads.stop):  # the sender holds what it sends
                assert rank_heads(kv_heads, p_tp, r).start <= h < rank_heads(kv_heads, p_tp, r).stop
    for d in range(d_tp):
        heads = rank_heads(kv_heads, d_tp, d)
        for s, t in zip(src_blocks, dst_blocks):
            assert torch.equal(d_caches[d][t], full[s, heads.start:heads.stop]), (d, s, t)
        untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
        assert (d_caches[d][untouched] == -1.0).all()
        # the decode rank expects exactly the parts that were sent to it
        assert sorted(expected_parts("T", kv_heads, p_tp, d_tp, d)) == sorted(
            p for p, plan in sent.items() if plan.decode_rank == d)
    # a replicated head is sent by one prefill rank only
    per_head_senders = {}
    for pid, plan in sent.items():
        for h in range(plan.heads.start, plan.heads.stop):
            per_head_senders.setdefault((h, plan.decode_rank), set()).add(pid)
    assert all(len(v) == 1 for v in per_head_senders.values())


def test_gqa_replicated_heads_are_sent_by_the_first_replica():
    # 2 KV heads, prefill TP 4: ranks 0,1 hold head 0 and ranks 2,3 head 1
    assert [rank_heads(2, 4, r) for r in range(4)] == [HeadSlice(0, 1), HeadSlice(0, 1),
                                                        HeadSlice(1, 2), HeadSlice(1, 2)]
    assert [source_rank(h, 2, 4) for h in range(2)] == [0, 2]
    assert plan_parts(2, 4, 1, 1) == [] and plan_parts(2, 4, 3, 2) == []
    assert [p.decode_rank for p in plan_parts(2, 4, 0, 2)] == [0]


@pytest.mark.parametrize("kv_heads,tp,mla,pp,match", [
    (3, 2, False, 1, "do not divide"), (2, 3, False, 1, "do not replicate"),
    (8, 2, True, 1, "MLA"), (8, 2, False, 2, "pipeline")])
def test_unsupported_configurations_are_refused_with_the_setting_named(kv_heads, tp, mla, pp, match):
    with pytest.raises(ValueError, match=match):
        check_tp(kv_heads, tp, mla, pp)
