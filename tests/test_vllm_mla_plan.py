"""MLA (latent) planning in tp.py without an engine: every decode rank gets every
pushed block once, the prefill ranks share the sending (each sends a contiguous
share within one block of an even split), decode ranks expect exactly the parts that
come, and chunking does not change who sends a block."""
import itertools

import pytest

from torch_kvops.heads import part_id
from torch_kvops.integrations.vllm.tp import check_tp, latent_expected_parts, latent_parts, latent_segment

pytestmark = [pytest.mark.unit, pytest.mark.vllm]


@pytest.mark.parametrize("total,p_tp,d_tp", list(itertools.product(range(0, 10), [1, 2, 3, 4], [1, 2, 4])))
def test_every_decode_rank_gets_every_block_once_and_prefill_ranks_share_it(total, p_tp, d_tp):
    got = {d: [] for d in range(d_tp)}
    per_pair, dst_of_pair = {}, {}
    dst = [200 + i for i in range(total)]
    for p in range(p_tp):
        for part in latent_parts(total, p_tp, p, d_tp):
            assert len(part.positions) > 0  # ranks with nothing to send are left out
            assert part.positions.step == 1  # contiguous: descriptors merge
            got[part.decode_rank].extend(part.positions)
            per_pair[part_id("T", "E", p, part.decode_rank)] = len(part.positions)
            dst_of_pair[part_id("T", "E", p, part.decode_rank)] = part.chunk(0, dst, dst)[1]
    for d in range(d_tp):
        assert sorted(got[d]) == list(range(total))  # all, once
        # the decode rank expects exactly the parts that come, filling what each sends
        assert latent_expected_parts("T", "E", dst, p_tp, d) == {
            k: v for k, v in dst_of_pair.items() if k.endswith(f"d{d}")}
        shares = [per_pair.get(part_id("T", "E", p, d), 0) for p in range(p_tp)]
        assert max(shares) - min(shares) <= 1, shares  # each P rank: 1/p_tp of it, +-1 block
    # the larger segments rotate over the prefill ranks
    per_prefill = [sum(n for k, n in per_pair.items() if k.startswith(f"T@E|p{p}d")) for p in range(p_tp)]
    assert max(per_prefill) - min(per_prefill) <= max(1, d_tp // p_tp + 1) if total else True


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_chunks_cut_inside_blocks_send_each_block_from_its_owner(p_tp, d_tp):
    """Chunked prefill: a chunk boundary inside a block pushes that block again with
    the next chunk; it must come from the same prefill rank, and every position of a
    part appears in its chunks (src and dst kept paired)."""
    total, block_size = 11, 16
    src = [100 + i for i in range(total)]
    dst = [200 + i for i in range(total)]
    bounds = [0, 40, 41, 120, total * block_size]  # token boundaries of four chunks
    owner = {}
    for lo, hi in zip(bounds, bounds[1:]):
        first, last = lo // block_size, -(-hi // block_size)
        for p in range(p_tp):
            for part in latent_parts(total, p_tp, p, d_tp):
                s, t = part.chunk(first, src[first:last], dst[first:last])
                assert [x - 100 for x in s] == [y - 200 for y in t]
                for pos in (x - 100 for x in s):
                    assert pos in part.positions
                    assert owner.setdefault((pos, part.decode_rank), p) == p
    assert len(owner) == total * d_tp


def test_bad_segments_and_mla_with_pipeline_parallelism_are_refused():
    with pytest.raises(ValueError, match="segment"):
        latent_segment(4, 2, 2)
    with pytest.raises(ValueError, match="blocks"):
        latent_segment(-1, 2, 0)
    check_tp(1, 2, True, 1)  # MLA with TP is accepted
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        check_tp(1, 2, True, 2)


class _Conn:
    def __init__(self, engine_id):
        self.engine_id = engine_id
        self.expected = {}  # part -> the blocks its begins may name

    def expect(self, tid, blocks=None):
        self.expected[tid] = set(blocks)
        return True


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_producer_chunks_and_consumer_expectations_agree(p_tp, d_tp):
    """The workers' side of the plan (no transport): every prefill rank's
    TransferRequests over two chunks of a 5-block request (block 2 cut by the chunk
    boundary, so pushed twice) deliver every block to every decode rank, parts with
    no block in a chunk go out empty (so the last chunk ends them), and each decode
    rank expects exactly the parts sent to it."""
    from torch_kvops.integrations.vllm.metadata import PushReq
    from torch_kvops.integrations.vllm.worker_consumer import ConsumerWorker
    from torch_kvops.integrations.vllm.worker_producer import ProducerWorker

    peers = [{"engine_id": f"D-{d}", "latent": True} for d in range(d_tp)]
    src, dst = [10, 11, 12, 13, 14], [20, 21, 22, 23, 24]
    chunks = [PushReq("r", "T", peers, src[0:3], dst[0:3], False, "layerwise", block_offset=0, total_blocks=5),
              PushReq("r", "T", peers, src[2:5], dst[2:5], True, "layerwise", block_offset=2, total_blocks=5)]
    received = {d: set() for d in range(d_tp)}
    sent_parts = {d: {} for d in range(d_tp)}  # part -> the blocks its requests name
    for p in range(p_tp):
        w = ProducerWorker.__new__(ProducerWorker)
        w.latent, w.tp_size, w.tp_rank = True, p_tp, p
        w._peer = lambda info: info["engine_id"]
        for k, push in enumerate(chunks):
            for req in w._plan(push):
                d = int(req.peer.split("-")[1])
                assert req.last_chunk == (k == 1)
                assert [s + 10 for s in req.src_blocks] == list(req.dst_blocks)
                received[d].update(req.dst_blocks)
                sent_parts[d].setdefault(req.req_id, set()).update(req.dst_blocks)
    for d in range(d_tp):
        assert received[d] == set(dst)
        c = ConsumerWorker.__new__(ConsumerWorker)
        c.latent, c._by_head, c.tp_size, c.tp_rank, c.conn = True, False, d_tp, d, _Conn(f"D-{d}")
        c._recv_blocks, c._recv_left, c._recv_tid_to_req, c._early, c._part_units = {}, {}, {}, {}, {}
        c._expect("r", "T", p_tp, dst)
        # the parts sent, each expected with the blocks its begins name (none refused)
        assert c.conn.expected == sent_parts[d]


def test_a_latent_cache_on_one_side_only_is_refused():
    from torch_kvops.integrations.vllm.metadata import PushReq
    from torch_kvops.integrations.vllm.worker_producer import ProducerWorker

    w = ProducerWorker.__new__(ProducerWorker)
    w.latent, w.tp_size, w.tp_rank = True, 1, 0
    push = PushReq("r", "T", [{"engine_id": "D", "by_head": True}], [1], [2], True, "layerwise", 0, 1)
    with pytest.raises(ValueError, match="one side only"):
        w._plan(push)
