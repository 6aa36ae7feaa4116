"""Tensor parallelism of different sizes on the two sides (issue 34), between real
processes over the real Mooncake engine: each prefill rank is a producer connector of
its own (its own transport), each decode rank a consumer process, every cache laid out
head-major as the vLLM adapter asks vLLM for it (``[blocks * local heads, block_size,
2 * head_dim]``: one transfer unit per head of a block, integrations/vllm/kv_layout.py).
Each prefill rank sends what ``tp.plan_parts`` plans, each decode rank expects what
``tp.expected_parts`` names; every decode rank's cache must equal a reference reshard of
the full cache, byte for byte, and no other block may change.

Negative control (``misplaced``): each part goes to the next decode rank's heads (the
plan of another rank): the reshard check fails.
"""
import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops.heads import expected_parts, part_id, plan_parts, rank_heads
from torch_kvops.testing.consumer_process import ConsumerProcess

pytestmark = [pytest.mark.process]

LAYERS, BLOCKS, BLOCK_SIZE, HEAD_DIM, KV_HEADS = 2, 8, 4, 8, 4
SRC, DST = [0, 3, 5], [6, 1, 2]
CONFIG = dict(transfer_timeout_s=5.0, lease_s=30.0)


def _full(layer):
    gen = torch.Generator().manual_seed(100 + layer)
    return torch.randn(BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=gen)


def _local(full, heads):
    """A rank's head-major cache as transfer units: [blocks * local heads, ...]."""
    return full[:, heads.start:heads.stop].contiguous().view(-1, BLOCK_SIZE, 2 * HEAD_DIM)


@pytest.mark.parametrize("p_tp,d_tp,case", [(2, 1, "exact"), (1, 2, "exact"), (2, 4, "exact"),
                                            (4, 2, "exact"), (2, 4, "misplaced")])
def test_every_decode_rank_gets_its_heads_from_the_prefill_ranks_that_hold_them(p_tp, d_tp, case):
    d_units = BLOCKS * len(rank_heads(KV_HEADS, d_tp, 0))
    consumers = [ConsumerProcess(LAYERS, d_units, (BLOCK_SIZE, 2 * HEAD_DIM), **CONFIG) for _ in range(d_tp)]
    producers = []
    try:
        for d, consumer in enumerate(consumers):
            consumer.call("fill", list(range(d_units)), -1.0)
        engines = [c.info["engine_id"] for c in consumers]
        for d in range(d_tp):
            parts = expected_parts("T", engines[d], DST, KV_HEADS, p_tp, d_tp, d)
            # each part's units, as the vLLM adapter's decode side expects them: a begin
            # naming any other unit would be refused
            assert consumers[d].call("expect", sorted(parts), parts) == [True] * len(parts)
        for r in range(p_tp):
            transport = MooncakeTransport(host="127.0.0.1")
            conn = LayerwiseConnector("producer", transport, ConnectorConfig(**CONFIG))
            producers.append((conn, transport))
            caches = [_local(_full(layer), rank_heads(KV_HEADS, p_tp, r)) for layer in range(LAYERS)]
            conn.register_kv_caches(caches)
            peers = [conn.add_peer(c.info) for c in consumers]
            requests = []
            for plan in plan_parts(KV_HEADS, p_tp, r, d_tp):
                src, dst = plan.units(SRC, DST)
                d = plan.decode_rank
                if case == "misplaced":  # another decode rank's units: a wrong plan
                    src = [u + (1 if u % 2 == 0 else -1) for u in src]
                requests.append(TransferRequest(part_id("T", engines[d], r, d), peers[d], src, dst))
            conn.start_step(requests)
            for layer, cache in enumerate(caches):
                conn.save_kv_layer(layer, cache)
            conn.wait_for_save(timeout=60)
        mismatched = []
        for d, consumer in enumerate(consumers):
            parts = expected_parts("T", engines[d], DST, KV_HEADS, p_tp, d_tp, d)
            assert consumer.call("wait", sorted(parts), 30.0)[0] == set(parts), f"decode rank {d}"
            received = consumer.call("caches")
            heads = rank_heads(KV_HEADS, d_tp, d)
            for layer in range(LAYERS):
                got = torch.from_numpy(np.asarray(received[layer])).view(BLOCKS, len(heads), BLOCK_SIZE,
                                                                         2 * HEAD_DIM)
                want = _full(layer)[SRC, heads.start:heads.stop]
                if not torch.equal(got[DST], want):
                    mismatched.append((d, layer))
                untouched = [b for b in range(BLOCKS) if b not in DST]
                assert (got[untouched] == -1.0).all(), f"decode rank {d}: a block outside the request changed"
        if case == "misplaced":
            assert mismatched, "misplaced heads passed the reshard check: it guards nothing"
        else:
            assert not mismatched, f"(decode rank, layer) not equal to the reference reshard: {mismatched}"
    finally:
        for conn, transport in producers:
            conn.close()
            transport.close()
        for consumer in consumers:
            consumer.stop()
