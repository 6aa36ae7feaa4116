"""Block spaces (``register_kv_caches(caches, spaces)``, plan.KVLayout.of): layers whose
blocks are allocated apart, as in a hybrid pool whose sliding layers have pages of their
own, take global block ids, each space's after the last of the one before, and a layer
moves the ids of its own space only. Between real processes over the real Mooncake
engine, integrity check off and on; then the plan's refusals.

Layers 0 and 1 (space 0) have 64 blocks, ids 0-63; layer 2 (space 1) has 16 blocks,
ids 64-79 on both sides. The consumer's caches start at -7: a block no request moves
must keep it. Negative control, kept: the producer's descriptors ignore the spaces
(block ids taken as each layer's own, as before spaces): the window's bytes do not
land where they belong.
"""
import numpy as np
import pytest
import torch

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport, TransferRequest
from torch_kvops import plan as plan_module
from torch_kvops.connector import peer_step
from torch_kvops.plan import KVLayout, validate_step
from torch_kvops.testing.consumer_process import ConsumerProcess

from test_integrity import BLOCK_SHAPE, FAST

pytestmark = [pytest.mark.process]

COUNTS, SPACES = [64, 64, 16], [0, 0, 1]
BASE = 64  # the first id of space 1
# the full layers' pages (layer 2 moves none of them) and the sliding layer's window
# (layers 0 and 1 move none of it): two requests of one room, as an adapter sends them
FULL = TransferRequest("full", "", [0, 1, 2, 7], [10, 11, 12, 20], layer_first_block={2: 4})
WINDOW = TransferRequest("window", "", [BASE + 3, BASE + 5], [BASE + 1, BASE + 2],
                         layer_first_block={0: 2, 1: 2})


def _for(req: TransferRequest, peer: str) -> TransferRequest:
    return TransferRequest(req.req_id, peer, req.src_blocks, req.dst_blocks,
                           layer_first_block=req.layer_first_block)


def _local(layer: int, block: int) -> int:
    return block - (BASE if SPACES[layer] else 0)


def expected_states():
    """(layer, the consumer's own block index) -> "moved" for every block a request
    moves; every other block is "kept"."""
    out = {}
    for req in (FULL, WINDOW):
        for layer in range(len(COUNTS)):
            for d in req.dst_blocks[req.first_block(layer):]:
                out[layer, _local(layer, d)] = "moved"
    return out


def run(check: str, monkeypatch=None):
    """Push both requests in one step; (finished, failed, consumer stats, per (layer,
    own block): "moved" (equal to its source), "kept" (-7) or "wrong")."""
    consumer = ConsumerProcess(len(COUNTS), COUNTS, BLOCK_SHAPE, integrity_check=check,
                               staging_threshold_bytes=0, spaces=SPACES, **FAST)
    transport = MooncakeTransport(host="127.0.0.1")
    try:
        caches = [torch.zeros(n, *BLOCK_SHAPE) for n in COUNTS]
        config = ConnectorConfig(integrity_check=check, staging_threshold_bytes=0, **FAST)
        with LayerwiseConnector("producer", transport, config) as conn:
            conn.register_kv_caches(caches, SPACES)
            peer = conn.add_peer(consumer.info)
            consumer.call("expect", ["full", "window"], {"full": FULL.dst_blocks, "window": WINDOW.dst_blocks})
            conn.start_step([_for(FULL, peer), _for(WINDOW, peer)])
            gen = torch.Generator().manual_seed(7)
            for layer, cache in enumerate(caches):
                cache.copy_(torch.randn(cache.shape, generator=gen))
                conn.save_kv_layer(layer, cache)
            conn.wait_for_save(timeout=30)
            finished, failed, _ = consumer.call("wait", ["full", "window"], 15.0)
            received = consumer.call("caches")
        sources = {}
        for req in (FULL, WINDOW):
            for layer in range(len(COUNTS)):
                first = req.first_block(layer)
                for s, d in zip(req.src_blocks[first:], req.dst_blocks[first:]):
                    sources[layer, _local(layer, d)] = caches[layer][_local(layer, s)].numpy()
        states = {}
        for layer, count in enumerate(COUNTS):
            for block in range(count):
                got = received[layer][block]
                source = sources.get((layer, block))
                states[layer, block] = ("moved" if source is not None and np.array_equal(got, source)
                                        else "kept" if (got == -7.0).all() else "wrong")
        return finished, failed, consumer.call("stats"), states
    finally:
        consumer.stop()
        transport.close()


def _states_of(states):
    return {key: state for key, state in states.items() if state != "kept"}


@pytest.mark.parametrize("check", ["off", "mac"])
def test_each_layer_moves_the_ids_of_its_own_space(check):
    finished, failed, stats, states = run(check)
    assert finished == {"full", "window"} and not failed
    assert _states_of(states) == expected_states()
    assert len(expected_states()) == 4 + 4 + 2  # layers 0 and 1: the pages; layer 2: the window
    assert stats["integrity_failures"] == 0


def test_negative_control_ids_taken_as_each_layers_own_misplace_the_window(monkeypatch):
    """The descriptors of the code before spaces: layer 2's ids 64+ taken as its own
    blocks, past its 16. The window does not land in layer 2's blocks 1 and 2."""
    def before_spaces(local, peer, src, dst):
        return original(local.__class__(**dict(local.__dict__, id_base=0)),
                        peer.__class__(**dict(peer.__dict__, id_base=0)), src, dst)

    original = plan_module.layer_descriptors
    monkeypatch.setattr(peer_step, "layer_descriptors", before_spaces)
    finished, failed, _, states = run("off")
    assert _states_of(states) != expected_states(), "the sabotage moved the window right: this test proves nothing"
    print(f"\n[block spaces] spaces ignored: {finished=} {failed=} layer 2 blocks 1, 2: {states[2, 1]}, {states[2, 2]}")
    assert [states[2, 1], states[2, 2]] != ["moved", "moved"]


def _layouts(spaces=SPACES):
    caches = [torch.zeros(n, *BLOCK_SHAPE) for n in COUNTS]
    layout = KVLayout.of(caches, spaces)
    return layout, {"p": layout}


def test_layouts_give_each_space_ids_after_the_last_space():
    layout, _ = _layouts()
    assert layout.id_bases == [0, 0, BASE] and layout.spaces == SPACES and layout.num_ids == BASE + 16
    assert not _layouts(None)[0].spaced and _layouts(None)[0].num_ids == 64
    caches = [torch.zeros(n, *BLOCK_SHAPE) for n in COUNTS]
    for bad in ([0, 1], [0, 0, 2], [1, 1, 1], [0, 0, 1.0]):
        with pytest.raises(ValueError, match="spaces"):
            KVLayout.of(caches, bad)
    with pytest.raises(ValueError, match="same block spaces"):
        layout.check_compatible(_layouts(None)[0])


@pytest.mark.parametrize("req, why", [
    # the full pages' request without layer 2's cut: layer 2 would move ids of space 0
    (TransferRequest("bad", "p", [0, 1], [10, 11]), "source block 0 is not a block of layer 2 locally"),
    (TransferRequest("bad", "p", [BASE + 1], [BASE + 2], layer_first_block={0: 1}),
     "source block 65 is not a block of layer 1"),
    (TransferRequest("bad", "p", [BASE + 1], [BASE + 16], layer_first_block={0: 1, 1: 1}),
     "destination block 80 is out of range on peer 'p' \\(80 blocks\\)"),
])
def test_ids_outside_a_layers_space_are_refused_before_anything_is_sent(req, why):
    local, peers = _layouts()
    with pytest.raises(ValueError, match=why):
        validate_step([req], local, peers, {})
    plan = validate_step([req, _for(FULL, "p")], local, peers, {}, partial=True)
    assert list(plan.refused) == ["bad"] and [r.req_id for r in plan.requests] == ["full"]


def test_one_own_index_in_two_spaces_is_two_blocks():
    """Block 10 of space 0 and block 10 of space 1 (id 74) are named by two requests
    without a clash; id 74 named twice is one."""
    local, peers = _layouts()
    window = TransferRequest("w", "p", [BASE + 10], [BASE + 10], layer_first_block={0: 1, 1: 1})
    plan = validate_step([_for(FULL, "p"), window], local, peers, {}, partial=True)
    assert not plan.refused
    again = TransferRequest("w2", "p", [BASE + 11], [BASE + 10], layer_first_block={0: 1, 1: 1})
    plan = validate_step([window, again], local, peers, {}, partial=True)
    assert list(plan.refused) == ["w2"] and "destination block 74" in plan.refused["w2"][1]
