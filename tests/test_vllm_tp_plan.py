"""Tensor-parallel head planning (tp.py) without an engine: every prefill/decode TP
combination moves every KV head of every block exactly once per decode rank that
holds it, byte-exact, from a prefill rank that holds it."""
import itertools

import pytest
import torch

from torch_kvops.heads import HeadSlice, expected_parts, part_id, plan_parts, rank_heads, source_rank
from torch_kvops.integrations.vllm.tp import check_tp

pytestmark = [pytest.mark.unit, pytest.mark.vllm]

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
            pid = part_id("T", "E", r, plan.decode_rank)
            assert pid not in sent
            sent[pid] = (plan, dst)
            for h in range(plan.heads.start, plan.heads.stop):  # the sender holds what it sends
                assert rank_heads(kv_heads, p_tp, r).start <= h < rank_heads(kv_heads, p_tp, r).stop
    for d in range(d_tp):
        heads = rank_heads(kv_heads, d_tp, d)
        for s, t in zip(src_blocks, dst_blocks):
            assert torch.equal(d_caches[d][t], full[s, heads.start:heads.stop]), (d, s, t)
        untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
        assert (d_caches[d][untouched] == -1.0).all()
        # the decode rank expects exactly the parts that were sent to it, each filling
        # exactly the units its prefill rank writes
        assert expected_parts("T", "E", dst_blocks, kv_heads, p_tp, d_tp, d) == {
            pid: dst for pid, (plan, dst) in sent.items() if plan.decode_rank == d}
    # a replicated head is sent by one prefill rank only
    per_head_senders = {}
    for pid, (plan, _) in sent.items():
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
    (8, 2, False, 2, "pipeline")])
def test_unsupported_configurations_are_refused_with_the_setting_named(kv_heads, tp, mla, pp, match):
    with pytest.raises(ValueError, match=match):
        check_tp(kv_heads, tp, mla, pp)


def _decode_worker(local_heads: int, by_head: bool):
    """A decode worker's partial-failure bookkeeping alone (no transport)."""
    from torch_kvops.integrations.vllm.metrics import StatsCollector
    from torch_kvops.integrations.vllm.worker_consumer import ConsumerWorker

    worker = ConsumerWorker.__new__(ConsumerWorker)
    worker.heads, worker._by_head = HeadSlice(0, local_heads), by_head
    worker._recv_left, worker._recv_blocks, worker._recv_valid = {}, {}, {}
    worker._recv_bad, worker._ended_ok, worker._ended_failed = set(), set(), set()
    worker._load_errors, worker.metrics = set(), StatsCollector("consumer")
    worker._recv_tid_to_req, worker._part_units = {}, {}
    return worker


@pytest.mark.parametrize("local_heads,by_head", [(1, False), (2, True)])
def test_a_part_failed_part_way_keeps_only_blocks_filled_whole_by_every_part(local_heads, by_head):
    """Two prefill ranks each send one head per block (units block * heads + head when
    by head). Rank 0's part landed chunks of blocks [7, 3, 9] and [9, 4] (9 cut by the
    boundary) then failed; rank 1's landed [7, 3, 9] then failed. Only 7 and 3 are
    whole on both: 9, 4 and 5 are load errors, the request is reported received."""
    w = _decode_worker(local_heads, by_head)

    def units(blocks, head):
        return [b * local_heads + (head if by_head else 0) for b in blocks]

    w._recv_left["r"], w._recv_blocks["r"] = {"a", "b"}, [7, 3, 9, 4, 5]
    w._part_failed("r", w._valid_blocks([units([7, 3, 9], 0), units([9, 4], 0)]))
    w._part_failed("r", w._valid_blocks([units([7, 3, 9], 1 % local_heads)]))
    w._recv_ended("r")
    assert w._ended_ok == {"r"} and not w._ended_failed
    assert w.get_block_ids_with_load_errors() == {9, 4, 5}
    assert w.get_block_ids_with_load_errors() == set(), "reported once"


def test_a_part_that_landed_nothing_fails_the_whole_request():
    w = _decode_worker(1, False)
    w._recv_left["r"], w._recv_blocks["r"] = {"a"}, [7, 3]
    w._part_failed("r", w._valid_blocks([[7], []]))  # its only landed block may be cut
    w._recv_ended("r")
    assert w._ended_failed == {"r"} and w.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("local_heads,by_head", [(1, False), (2, True)])
def test_a_part_reported_finished_with_a_hole_makes_the_hole_a_load_error(local_heads, by_head):
    """A part whose every chunk landed but whose chunks do not cover every unit it was
    expected to fill (P left block 9 out): the blocks not covered are load errors, the
    request is reported received; a part that covers them all leaves none."""
    w = _decode_worker(local_heads, by_head)

    def units(blocks):
        return [b * local_heads + h for b in blocks for h in range(local_heads)]

    for req, landed in (("hole", [units([7, 3]), units([3, 4])]), ("whole", [units([7, 3]), units([9, 4])])):
        w._recv_left[req], w._recv_blocks[req] = {req + "|p0"}, [7, 3, 9, 4]
        w._recv_tid_to_req[req + "|p0"], w._part_units[req + "|p0"] = req, units([7, 3, 9, 4])
        w._part_ended(req + "|p0", True, landed)
        assert w._ended_ok >= {req} and not w._ended_failed
    assert w.get_block_ids_with_load_errors() == {9}
    assert w.metrics._pending.data.get("incomplete_transfers") == 1
