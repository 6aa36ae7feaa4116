"""``TransferRequest.layer_first_block``: a layer that moves only a request's blocks
from the k-th on (a sliding-window layer's window), between real processes over the
real Mooncake engine, on both write paths, with the consumer's integrity check on and
off.

The consumer's caches start at -7: a block a layer does not move must keep it, every
other block must equal the producer's. The negative control (the check still catches
misplaced bytes when layers move fewer blocks) is kept; the one for the placement
itself is every comparison below, seen red with the windows ignored by the lanes.
"""
import numpy as np
import pytest
import torch

from torch_kvops import TransferRequest
from torch_kvops.plan import KVLayout, validate_step

from test_integrity import BLOCK_BYTES, BLOCK_SHAPE, BLOCKS, LAYERS, PATHS, linked

pytestmark = [pytest.mark.process]
# two chunks of request "r"; per chunk, layer -> the first block it moves
CHUNKS = [([0, 1, 2, 3], [10, 11, 12, 13], {0: 3, 2: 4}, False),
          ([7, 30, 31], [20, 40, 41], {0: 1}, True)]


def push(conn, caches, peer) -> None:
    gen = torch.Generator().manual_seed(3)
    for src, dst, firsts, last in CHUNKS:
        conn.start_step([TransferRequest("r", peer, src, dst, last_chunk=last, layer_first_block=firsts)])
        idx = torch.tensor(src)
        for layer, cache in enumerate(caches):
            cache.index_copy_(0, idx, torch.randn(len(src), *BLOCK_SHAPE, generator=gen))
            conn.save_kv_layer(layer, cache)
        conn.wait_for_save(timeout=30)


def run(path: str, check: str, how=None):
    """Push "r"; returns (finished, failed, consumer stats, producer's bytes sent,
    per (layer, block): "moved" (equal to the source), "kept" (still -7) or "wrong")."""
    with linked(path, how, check, check) as (conn, caches, peer, consumer):
        push(conn, caches, peer)
        finished, failed, _ = consumer.call("wait", ["r"], 15.0)
        received = consumer.call("caches")
        states = {}
        for src, dst, _, _ in CHUNKS:
            for s, d in zip(src, dst):
                for layer in range(LAYERS):
                    got = received[layer][d]
                    states[layer, d] = ("moved" if np.array_equal(got, caches[layer][s].numpy())
                                        else "kept" if (got == -7.0).all() else "wrong")
        return finished, failed, consumer.call("stats"), conn.stats()["bytes_sent"], states


def expected_states():
    out = {}
    for _, dst, firsts, _ in CHUNKS:
        for k, d in enumerate(dst):
            for layer in range(LAYERS):
                out[layer, d] = "moved" if k >= firsts.get(layer, 0) else "kept"
    return out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("check", ["off", "mac"])
def test_each_layer_moves_its_blocks_from_its_first_and_leaves_the_others(path, check):
    finished, failed, stats, sent, states = run(path, check)
    assert finished == {"r"} and not failed
    assert states == expected_states()
    moved_blocks = sum(1 for s in expected_states().values() if s == "moved")
    assert moved_blocks == 4 + 1 + 0 + 3 + 2 + 3  # chunk 1: layers 0-2, chunk 2: layers 0-2
    assert sent == moved_blocks * BLOCK_BYTES
    assert stats["integrity_failures"] == 0


@pytest.mark.parametrize("mode", ["checksum", "mac"])
def test_the_check_still_catches_misplaced_bytes_in_a_window(mode):
    finished, failed, stats, _, _ = run("direct", mode, how="misplace")
    assert failed == {"r"} and not finished
    assert stats["integrity_failures"] >= 1


def layouts():
    caches = [torch.zeros(BLOCKS, *BLOCK_SHAPE) for _ in range(LAYERS)]
    layout = KVLayout.of(caches)
    return layout, {"p": layout}


@pytest.mark.parametrize("firsts, why", [
    ({LAYERS: 1}, "names layer"),
    ({-1: 1}, "names layer"),
    ({0: 4}, "not within its 3 blocks"),
    ({0: -1}, "not within its 3 blocks"),
    ({0: 1.0}, "not within its 3 blocks"),
    ({0: 3, 1: 3, 2: 3}, "moves none of its 3 blocks"),
])
def test_bad_windows_are_refused_before_anything_is_sent(firsts, why):
    local, peers = layouts()
    bad = TransferRequest("bad", "p", [1, 2, 3], [4, 5, 6], layer_first_block=firsts)
    with pytest.raises(ValueError, match=why):
        validate_step([bad], local, peers, {})
    plan = validate_step([bad, TransferRequest("ok", "p", [1], [9], layer_first_block={0: 1})],
                         local, peers, {}, partial=True)
    assert list(plan.refused) == ["bad"] and [r.req_id for r in plan.requests] == ["ok"]
