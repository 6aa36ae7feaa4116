"""The SGLang backend's parts that need no SGLang, in this environment: its fleet key
(the settings: the key, and no server reachable beyond its host without one; the
signing of its ZMQ messages, integrations/sglang/signing.py), what it refuses
(support.py), the KV heads each rank sends and expects with
unequal attention TP (heads.py), the check of a restarted prefill server (prefill_restarts.py) and the ids
of a room's transfers (transfers.py).
tests/test_sglang_pd.py runs them in real SGLang servers, a prefill server with another
key among them."""
import json
import logging
import threading
import time
from types import SimpleNamespace as NS
from typing import Dict

import numpy as np
import pytest
import torch

from torch_kvops.integrations.sglang.prefill_restarts import cached_endpoints, prefill_restarted
from torch_kvops.integrations.sglang.settings import CONFIG_ENV, KvopsSglangSettings
from torch_kvops.integrations.sglang import decode_peers
from torch_kvops.integrations.sglang.decode_peers import HELD, DecodePeers
from torch_kvops.integrations.sglang.signing import MessageSigner, SignedAborts
from torch_kvops.heads import rank_heads
from torch_kvops.integrations.sglang.heads import RankHeads, destination_ranks
from torch_kvops.integrations.sglang.support import check_supported, tp_problem
from torch_kvops.integrations.sglang.swa_pool import window_ids_frame, window_pages
from torch_kvops.integrations.sglang.transfers import Destination, destination, room_of, transfer_id

from conftest import FLEET_KEY as KEY  # key_file (the fixture) holds it

pytestmark = [pytest.mark.unit, pytest.mark.sglang]

ROUTED = "198.18.0.1"  # an address beyond this host (is_loopback needs no interface)


def _settings(monkeypatch, **raw) -> KvopsSglangSettings:
    monkeypatch.setenv(CONFIG_ENV, json.dumps(raw))
    return KvopsSglangSettings.from_env()


def test_what_the_backend_does_not_move_yet_is_refused_at_start_up():
    """A model's state pools, pipeline parallelism or data-parallel attention: a clear
    error when the manager starts, never a transfer that moves the wrong buffers (an
    MLA model and tensor parallelism start: tests/test_sglang_mla.py, test_sglang_tp.py)."""
    check_supported(NS(), NS(device="cpu", tp_size=2))
    with pytest.raises(NotImplementedError, match=r"^the kvops SGLang backend does not support "
                       r"state pools \['mamba'\] yet$"):
        check_supported(NS(state_types=["mamba"]), NS(device="cpu"))
    # SGLang's hybrid sliding-window pool moves by page (swa_pool.py); otherwise the error
    # names the flag that moves the model in one pool
    check_supported(NS(state_types=[NS(value="swa")]), NS(device="cpu"))
    for unit, latent, what in (("head", False, "with mha_unit 'head'"), ("page", True, "of MLA")):
        with pytest.raises(NotImplementedError, match=r"^the kvops SGLang backend does not support a "
                           rf"hybrid sliding-window pool {what} \(moved by page only; or "
                           r"--disable-hybrid-swa-memory on every server of the fleet\) yet$"):
            check_supported(NS(state_types=[NS(value="swa")]), NS(device="cpu"), unit, latent)
    with pytest.raises(NotImplementedError, match=r"state pools \['mamba'\] yet$"):
        check_supported(NS(state_types=["swa", "mamba"]), NS(device="cpu"))
    with pytest.raises(NotImplementedError, match="^the kvops SGLang backend does not support "
                       "pipeline parallelism, data-parallel attention yet$"):
        check_supported(NS(), NS(device="cpu", tp_size=2, pp_size=2, attn_dp_size=2))


def _pool(tokens: int, heads: RankHeads, full: torch.Tensor) -> torch.Tensor:
    """A rank's K buffer as SGLang lays it out (``[tokens, local heads, head_dim]``),
    holding its heads of ``full`` (``[tokens, total heads, head_dim]``)."""
    held = rank_heads(heads.total, heads.tp_size, heads.rank)
    return full[:, held.start:held.stop].contiguous()


@pytest.mark.parametrize("total,prefill_tp,decode_tp", [
    (2, 2, 1), (2, 1, 2), (8, 4, 2), (8, 2, 4), (8, 2, 2), (2, 4, 1), (2, 1, 4), (4, 8, 2),
    (1, 2, 2), (1, 4, 2), (2, 4, 4), (1, 2, 4), (2, 8, 4)])
def test_head_parts_land_each_decode_ranks_heads_where_its_pool_holds_them(total, prefill_tp, decode_tp):
    """Every prefill rank's parts, copied unit by unit through the views the backend
    registers, fill each decode rank's pool exactly with its heads, and the decode rank
    expects exactly the parts and units the prefill ranks send (ids both sides derive).
    Only the prefill ranks SGLang sends a decode rank's destination to may send it
    anything (:func:`destination_ranks`). Fewer KV heads than ranks: of the replicas
    among those, the lowest sends."""
    page, pages, dim = 4, 6, 3
    full = torch.randn(pages * page, total, dim)
    senders = [RankHeads(total, prefill_tp, r, page) for r in range(prefill_tp)]
    sources = [_pool(pages * page, h, full) for h in senders]
    src_pages, dst_pages = [0, 1, 2], [5, 3, 4]  # a room's pages on either side
    for d in range(decode_tp):
        receiver = RankHeads(total, decode_tp, d, page)
        pool = torch.zeros(pages * page, receiver.local, dim)
        dst_units = receiver.unit_views([pool.view(pages, -1).view(torch.uint8)])[0]
        expected = receiver.expected(77, "dsession", dst_pages, prefill_tp)
        sent = {}
        for h, source in zip(senders, sources):
            if h.rank not in destination_ranks(prefill_tp, decode_tp, d):
                continue  # SGLang never sends it this decode rank's destination
            part = h.plan_to(decode_tp, d)
            if part is None:
                continue
            dest = Destination("peer", "tcp://d:1", np.asarray(dst_pages), 0, "dsession", h, part)
            request = dest.request(77, src_pages, slice(0, 3), last=True)
            sent[request.req_id] = request.dst_blocks
            src_units = h.unit_views([source.view(pages, -1).view(torch.uint8)])[0]
            dst_units[request.dst_blocks] = src_units[request.src_blocks]
        assert sent == expected and all(room_of(t) == 77 for t in sent)
        held = rank_heads(total, decode_tp, d)
        for src_page, dst_page in zip(src_pages, dst_pages):
            want = full[src_page * page:(src_page + 1) * page, held.start:held.stop]
            assert torch.equal(pool[dst_page * page:(dst_page + 1) * page], want)
        untouched = [p for p in range(pages) if p not in dst_pages]
        assert not pool.view(pages, -1)[untouched].any()


def test_attention_tp_sizes_the_backend_does_not_move_between_are_refused_with_the_reason():
    """By page (the default), MHA moves between equal sizes only, and the reason names
    the setting that moves it by head; by head, between sizes that split the heads; MLA
    between any sizes."""
    assert tp_problem(False, None, 2, 2) == tp_problem(True, None, 1, 4) == ""
    assert tp_problem(False, None, 2, 1) == (
        "the kvops backend moves MHA KV by page between equal attention TP sizes only (prefill 2, "
        "decode 1): set \"mha_unit\": \"head\" in $KVOPS_SGLANG_CONFIG on every server of the fleet")
    heads = RankHeads(4, 2, 0, 16)
    assert tp_problem(False, heads, 1, 2) == tp_problem(False, heads, 4, 2) == ""
    assert tp_problem(False, heads, 3, 2) == heads.tp_problem(3)
    assert heads.tp_problem(1) == heads.tp_problem(4) == heads.tp_problem(8) == ""
    assert heads.tp_problem(3) == "attention TP 3 against 2 here: 4 KV heads do not divide over 3 ranks"
    with pytest.raises(ValueError, match="do not split into 16 tokens of 2 KV heads"):
        heads.unit_views([torch.zeros(2, 100, dtype=torch.uint8)])


def test_a_signed_message_opens_only_whole_and_under_the_same_key():
    signer = MessageSigner(KEY)
    frames = [b"KVOPS_AUX", b"42", b"\x01\x02"]
    signed = signer.sign(frames)
    assert len(signed) == 4 and signer.open(signed) == frames
    assert MessageSigner(bytes(KEY)).open(signed) == frames  # any server holding the key
    for forged in (frames,  # unsigned
                   [b"KVOPS_AUX", b"43", b"\x01\x02", signed[-1]],  # a frame changed
                   [b"KVOPS_AUX4", b"2", b"\x01\x02", signed[-1]],  # frames cut elsewhere
                   signed[:-1] + [signed[-1][:-1]],  # a short MAC
                   MessageSigner(b"k" * 32).sign(frames),  # another fleet's key
                   [signed[-1]]):
        with pytest.raises(ValueError, match="not signed with the fleet key"):
            signer.open(forged)
    unsigned = MessageSigner(None)  # no key: as before, nothing added or checked
    assert not unsigned.enabled and unsigned.sign(frames) == frames and unsigned.open(frames) == frames


def test_sglangs_abort_notice_leaves_signed_and_the_backends_messages_as_they_are():
    class Socket:  # what SGLang's receiver holds: a ZMQ socket (only what is sent matters)
        sent = []

        def send_multipart(self, frames):
            self.sent.append(list(frames))

    signer = MessageSigner(KEY)
    sock = SignedAborts(Socket(), signer, b"ABORT")
    abort = [b"ABORT", b"17", b"127.0.0.1", b"4000", b"3"]  # AbortNotification.to_zmq()
    ours = signer.sign([b"17", b"127.0.0.1", b"4000"])  # a destination, signed when built
    sock.send_multipart(abort)
    sock.send_multipart(ours)
    assert signer.open(Socket.sent[0]) == abort, "the abort notice opens under the fleet key"
    assert Socket.sent[1] == ours, "a message of the backend is not signed twice"
    with pytest.raises(ValueError):
        MessageSigner(b"k" * 32).open(Socket.sent[0])


def test_the_fleet_key_comes_from_the_settings_or_the_environment(monkeypatch, key_file, tmp_path):
    monkeypatch.delenv("KVOPS_FLEET_KEY_FILE", raising=False)
    assert _settings(monkeypatch).fleet_key() is None
    assert _settings(monkeypatch, fleet_key_file=key_file).fleet_key() == KEY
    monkeypatch.setenv("KVOPS_FLEET_KEY_FILE", key_file)
    assert _settings(monkeypatch).fleet_key() == KEY
    monkeypatch.delenv("KVOPS_FLEET_KEY_FILE")
    readable = tmp_path / "readable.key"
    readable.write_bytes(KEY)
    readable.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):  # at start-up, not at the first message
        _settings(monkeypatch, fleet_key_file=str(readable))
    with pytest.raises(ValueError, match="allow_insecure must be true or false"):
        _settings(monkeypatch, allow_insecure="yes")


def test_a_server_beyond_loopback_needs_a_fleet_key_or_allow_insecure(monkeypatch, key_file, caplog):
    monkeypatch.delenv("KVOPS_FLEET_KEY_FILE", raising=False)
    _settings(monkeypatch).check_exposure("127.0.0.1")  # loopback only: a single host
    with pytest.raises(ValueError, match="without a fleet key"):
        _settings(monkeypatch).check_exposure(ROUTED)
    _settings(monkeypatch, fleet_key_file=key_file).check_exposure(ROUTED)
    with caplog.at_level(logging.WARNING):
        _settings(monkeypatch, allow_insecure=True).check_exposure(ROUTED)
    assert "without a fleet key" in caplog.text and "allow_insecure: true" in caplog.text


def test_a_prefill_whose_rank_moved_is_found_restarted():
    """What the decode side asks a prefill's bootstrap server after a heartbeat: a
    cached rank at another endpoint now is a restart; the same endpoint, or no rank
    (not registered yet: 503), is not. A real HTTP server answers as SGLang's
    bootstrap server does (GET /route with the rank's query)."""
    import http.server

    answer = {"status": 200, "body": {"rank_ip": "127.0.0.1", "rank_port": 5001}}
    queries = []

    class Bootstrap(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            queries.append(self.path)
            body = answer["body"]
            if self.path.endswith("target_tp_rank=1&target_pp_rank=0"):  # rank 1 of 2
                body = dict(body, rank_port=body["rank_port"] + 100)
            body = json.dumps(body).encode()
            self.send_response(answer["status"])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bootstrap)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    addr = f"127.0.0.1:{server.server_address[1]}"
    try:
        pool = {f"{addr}_0_0_0": [{"rank_ip": "127.0.0.1", "rank_port": 5001, "pp_rank": 0}],
                "10.0.0.9:8998_0_0_0": [{"rank_ip": "10.0.0.9", "rank_port": 7}]}  # another prefill
        cached = cached_endpoints(pool, addr)
        assert [q for q, _ in cached] == [
            "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"]
        assert not prefill_restarted(addr, cached)  # the same endpoint
        answer["body"] = {"rank_ip": "127.0.0.1", "rank_port": 5002}
        assert prefill_restarted(addr, cached)  # restarted: its rank moved
        answer.update(status=503, body={"error": "Prefill server not fully registered yet"})
        assert not prefill_restarted(addr, cached)  # says nothing: asked again next time
        assert all(q.startswith("/route?prefill_dp_rank=0") for q in queries), queries
        # MLA, P TP 2 -> D TP 1: one entry holds rank 0 (sends) and rank 1 (a dummy),
        # asked for by their own TP ranks (SGLang's rank mapping), not by the key's
        answer.update(status=200, body={"rank_ip": "127.0.0.1", "rank_port": 5001})
        pool = {f"{addr}_0_0_0": [{"rank_ip": "127.0.0.1", "rank_port": 5001, "pp_rank": 0},
                                  {"rank_ip": "127.0.0.1", "rank_port": 5101, "pp_rank": 0}]}
        cached = cached_endpoints(pool, addr, target_tp_ranks=[0, 1])
        assert [q[-len("target_tp_rank=1&target_pp_rank=0"):] for q, _ in cached] == [
            "target_tp_rank=0&target_pp_rank=0", "target_tp_rank=1&target_pp_rank=0"]
        assert not prefill_restarted(addr, cached)
        # without the mapping two ranks under one key cannot be told apart: not asked
        assert cached_endpoints(pool, addr) == []
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_room_pushed_to_two_decode_ranks_is_two_transfers_both_sides_name_alike():
    """P names a transfer by the room and the decode rank's engine id (its destination
    message's session); D by the room and its own engine id: the same string, another
    for each decode rank, and the room back from either."""
    room = 9186877197885410583  # SGLang's rooms are 64-bit
    ranks = [Destination("peer0", "tcp://d:1", None, 0, "a1b2c3d4e5f6"),
             Destination("peer1", "tcp://d:2", None, 0, "0f1e2d3c4b5a")]
    ids = [d.transfer(room) for d in ranks]
    assert ids == [transfer_id(room, "a1b2c3d4e5f6"), transfer_id(room, "0f1e2d3c4b5a")]
    assert len(set(ids)) == 2 and [room_of(t) for t in ids] == [room, room]


def test_mha_unit_is_page_by_default_and_a_bad_value_fails_at_start_up(monkeypatch):
    assert _settings(monkeypatch).mha_unit == "page"
    assert _settings(monkeypatch, mha_unit="head").mha_unit == "head"
    with pytest.raises(ValueError, match=r"mha_unit 'token' is not one of \('page', 'head'\)"):
        _settings(monkeypatch, mha_unit="token")


def test_a_decode_rank_moving_mha_kv_by_the_other_unit_is_refused_naming_the_setting():
    """Prefill by head, decode by page, or the reverse: no destination, the room fails
    with the setting named (the link is refused first, naming it too: below)."""
    heads, theirs = RankHeads(2, 1, 0, 16), {"total": 2, "tp_size": 2, "rank": 0}
    assert destination(heads, theirs, "peer", "tcp://d:1", np.arange(2), 0, "s").part is not None
    assert destination(None, None, "peer", "tcp://d:1", np.arange(2), 0, "s").part is None
    for mine, other in ((heads, None), (None, theirs)):
        with pytest.raises(ValueError, match="set the same mha_unit on every server of the fleet"):
            destination(mine, other, "peer", "tcp://d:1", np.arange(2), 0, "s")


class _Links:
    """The connector as DecodePeers uses it, for its bookkeeping alone: ranks whose
    session starts with "live" link, the others fail to connect."""

    def add_peer(self, info: dict) -> str:
        if not info["engine_id"].startswith("live"):
            raise ConnectionError("refused")
        return f"peer-{info['engine_id']}"

    def peer_failed(self, peer: str):
        return None


def test_decode_registrations_stay_bounded_while_decode_servers_restart(monkeypatch):
    """Each restart of a decode server registers its ranks under new sessions: past
    MAX_SESSIONS the least recently used ranks with no link, attempt or held room are
    forgotten (a forgotten rank's next room fails as unregistered); a linked rank never
    is, however long unused. Seen red without the bound: all 26 kept."""
    monkeypatch.setattr(decode_peers, "MAX_SESSIONS", 8)
    peers = DecodePeers(_Links(), threading.RLock(), replay=lambda msg: None, fail=lambda room, why: None)
    try:
        peers.register("live-0", {"engine_id": "live-0"})
        for i in range(24):  # restarted ranks that never link
            peers.register(f"gone-{i}", {"engine_id": f"gone-{i}"})
        deadline = time.monotonic() + 10.0
        while len(peers) > 8 and time.monotonic() < deadline:
            peers.register("gone-last", {"engine_id": "gone-last"})  # forgets once attempts ended
            time.sleep(0.05)
        assert len(peers) <= 8
        assert peers.registration("live-0") == {"engine_id": "live-0"}
        assert peers.peer("live-0", [b"1"]) == "peer-live-0"
        assert peers.registration("gone-0") is None and peers.peer("gone-0", [b"1"]) is None
    finally:
        peers.close()


def test_a_decode_rank_registered_with_the_other_unit_is_never_linked_and_its_rooms_name_the_setting():
    """A prefill rank by head and a decode rank by page (or the reverse; a fleet that
    mixes them): its room fails naming ``mha_unit`` (when the attempt its registration
    began ends, or at once if it already did), and no link is tried (the
    layout check would refuse it naming bytes only, or, where sizes happen to agree,
    link it). Seen red without the check: the room failed with "refused"."""
    failed, heads = {}, RankHeads(2, 1, 0, 16)
    done = threading.Event()
    peers = DecodePeers(_Links(), threading.RLock(), replay=lambda msg: None,
                        fail=lambda room, why: (failed.update({room: why}), done.set()), heads=heads)
    try:
        peers.register("mixed", {"engine_id": "mixed"})  # no sglang_heads: by page
        try:
            assert peers.peer("mixed", [b"7", b"127.0.0.1", b"5000"]) in (HELD, None)
        except RuntimeError as e:  # the attempt its registration began failed first
            failed[7] = str(e)
            done.set()
        assert done.wait(10.0)
        assert "set the same mha_unit on every server of the fleet" in failed[7], failed
        peers.register("live-by-head", {"engine_id": "live-by-head", "sglang_heads": {"total": 2}})
        deadline = time.monotonic() + 10.0
        while peers.peer("live-by-head", [b"8", b"127.0.0.1", b"5000"]) != "peer-live-by-head":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        peers.close()


@pytest.mark.parametrize("skipped", [0, 32])
def test_the_forward_pushes_the_pages_past_the_decode_sides_prefix_as_sglang_counts_them(skipped):
    """The layer-wise plan of a 100-token prompt in chunks of 48 tokens, pages of 16,
    when the decode side holds its first ``skipped`` tokens (SGLang's decode radix
    cache): only the pages past them leave, into the destination's pages from its
    first, and the pages pushed are counted as SGLang's ``send()`` counts them (seen
    red without the skip: the prompt's first pages left)."""
    from torch_kvops.integrations.sglang.layerwise import LayerwisePrefill

    page, prompt, room = 16, 100, 7
    dest = Destination("peer", "tcp://d", np.arange(500, 500 + 7 - skipped // page), 0, "d1")
    manager = NS(ready_destinations=lambda r: [dest] if r == room else [], counts=NS(add=lambda *a: None))
    plan = LayerwisePrefill(manager, page, num_buffers=4)
    plan.track("rid", room, prompt)
    plan.skip_decode_prefix(room, skipped)
    req_to_token = torch.arange(1024).reshape(4, 256) + 16 * 1000  # row 1: pages 1016...
    sent_src, sent_dst = [], []
    for start, length in ((0, 48), (48, 48), (96, 4)):
        batch = NS(rids=["rid"], req_pool_indices=torch.tensor([1]), extend_prefix_lens_cpu=[start],
                   extend_seq_lens_cpu=[length])
        for req in plan.plan(batch, req_to_token):
            sent_src += list(req.src_blocks)
            sent_dst += list(req.dst_blocks)
    first_page = 1000 + 256 // page + skipped // page
    assert sent_src == list(range(first_page, 1000 + 256 // page + 7))
    assert sent_dst == dest.pages.tolist()
    # SGLang's send() after each forward (pages counted past the prefix): nothing left
    pages = req_to_token[1, skipped:prompt:page].numpy() // page
    assert plan.hand_off(room, pages, slice(0, len(pages)))[0].size == 0 and plan.pushed_last(room)


def test_a_room_whose_cached_prefix_leaves_before_its_forward_is_pushed_in_order_by_the_push_thread():
    """SGLang's early send of a prefix the prefill holds cached (before the forward that
    computes the rest) hands its pages to the push thread; the forward then pushes none
    of the room, and SGLang's send() after it hands the rest over, so the room's chunks
    leave in order (seen red before: the forward pushed the whole room, its last chunk
    ended it, and the early chunk was refused as "already reported finished")."""
    from torch_kvops.integrations.sglang.layerwise import LayerwisePrefill

    page, room = 16, 9
    dest = Destination("peer", "tcp://d", np.arange(500, 507), 0, "d1")
    manager = NS(ready_destinations=lambda r: [dest], counts=NS(add=lambda *a: None))
    plan = LayerwisePrefill(manager, page, num_buffers=4)
    plan.track("rid", room, 100)
    plan.skip_decode_prefix(room, 0)
    req_to_token = torch.arange(256).reshape(1, 256)
    early = plan.hand_off(room, np.arange(4), slice(0, 4))[0]  # 64 tokens cached
    assert early.tolist() == [0, 1, 2, 3]
    batch = NS(rids=["rid"], req_pool_indices=torch.tensor([0]), extend_prefix_lens_cpu=[64],
               extend_seq_lens_cpu=[36])
    assert plan.plan(batch, req_to_token) == []
    rest, index_slice = plan.hand_off(room, np.arange(4, 7), slice(4, 7))
    assert rest.tolist() == [4, 5, 6] and index_slice == slice(4, 7) and not plan.pushed_last(room)


def _windows(layer_windows, num_layers, counted=None):
    from torch_kvops.integrations.sglang.windows import SlidingWindows

    return SlidingWindows.of_layers(layer_windows, 0, num_layers, 2 * num_layers, 16,
                                    (counted if counted is not None else []).append)


def test_a_sliding_layer_moves_the_pages_of_its_window_and_a_full_layer_all():
    """4 layers alternating a window of 63 (SGLang's ``sliding_window_size`` for a
    64-token window) and full attention, pages of 16, a destination of 50 pages (785 to
    800 tokens): the window starts no earlier than page 50 - 1 - 4 = 45, so a sliding
    layer's K and V buffers (0, 2, 4, 6) move pages 45-49 only; nothing is dropped from a
    request, since the full layers move every page."""
    counted = []
    windows = _windows({0: 63, 1: -1, 2: 63, 3: -1}, 4, counted)
    assert windows.windows == {0: 63, 2: 63, 4: 63, 6: 63}
    assert windows.cut(50, 0, 16) == (0, {0: 16, 2: 16, 4: 16, 6: 16})
    assert windows.cut(50, 40, 10) == (0, {0: 5, 2: 5, 4: 5, 6: 5})
    assert windows.cut(50, 45, 5) == (0, {})
    assert windows.cut(3, 0, 3) == (0, {})  # a prompt shorter than the window
    assert sum(counted) == 4 * 16 + 4 * 5
    assert _windows({0: -1, 1: -1}, 2) is None  # no sliding layer


def test_pages_no_layer_moves_are_dropped_from_the_request():
    """Every layer sliding (Mistral-like): a chunk before the window moves nothing and
    names no page; one across its start names the window's pages only."""
    windows = _windows({0: 63, 1: 63}, 2)
    assert windows.cut(50, 0, 16) == (16, {})
    assert windows.cut(50, 40, 10) == (5, {})
    dest = Destination("peer", "tcp://d", np.arange(500, 550), 0, "d1", windowed=True)
    before = dest.request(7, list(range(16)), slice(0, 16), False, windows)
    assert list(before.src_blocks) == [] and list(before.dst_blocks) == [] and not before.layer_first_block
    across = dest.request(7, list(range(40, 50)), slice(40, 50), True, windows)
    assert list(across.src_blocks) == list(range(45, 50)) and list(across.dst_blocks) == list(range(545, 550))


def test_windows_apply_by_page_to_a_decode_rank_that_reads_windows_only():
    """A decode rank with SGLang's radix cache reads a finished prompt's pages again
    (a later prompt sharing its start), one whose attention backend ignores windows
    reads every token: every page of every layer goes to them. The registration says
    which; to a rank that does not say, every page."""
    windows = _windows({0: 63, 1: -1}, 2)
    pages = np.arange(500, 550)
    plain = destination(None, None, "peer", "tcp://d", pages, 0, "d1", windows_only=True)
    caching = destination(None, None, "peer", "tcp://d", pages, 0, "d1")
    req = plain.request(7, list(range(40, 50)), slice(40, 50), True, windows)
    assert dict(req.layer_first_block) == {0: 5, 2: 5} and list(req.dst_blocks) == list(range(540, 550))
    assert req.first_block(0) == 5 and req.first_block(1) == 0
    assert caching.request(7, list(range(40, 50)), slice(40, 50), True, windows).layer_first_block is None
    assert plain.request(7, list(range(40, 50)), slice(40, 50), True, None).layer_first_block is None


def test_by_head_a_sliding_layer_leaves_out_the_units_of_the_pages_before_its_window():
    """``"mha_unit": "head"``, 4 KV heads, P at TP 2 (rank 0: heads 0-1) to D at TP 1,
    pages of 16: a unit is one head of one token, 2 per token of this part, so the 5
    pages a sliding buffer skips in pages 40-49 of a 50-page destination are its first
    5 * 16 * 2 units; its other units, and a full buffer's, equal those moved without
    windows. To a D that does not read windows only, every unit."""
    windows = _windows({0: 63, 1: -1}, 2)
    heads = RankHeads(4, 2, 0, 16)
    pages = np.arange(500, 550)
    windowed = destination(heads, {"total": 4, "tp_size": 1, "rank": 0}, "peer", "tcp://d", pages, 0,
                           "d1", windows_only=True)
    every = destination(heads, {"total": 4, "tp_size": 1, "rank": 0}, "peer", "tcp://d", pages, 0, "d1")
    req = windowed.request(7, list(range(40, 50)), slice(40, 50), True, windows)
    full = every.request(7, list(range(40, 50)), slice(40, 50), True, windows)
    assert full.layer_first_block is None and len(full.src_blocks) == 10 * 16 * 2
    assert dict(req.layer_first_block) == {0: 5 * 16 * 2, 2: 5 * 16 * 2}
    assert list(req.src_blocks) == list(full.src_blocks) and list(req.dst_blocks) == list(full.dst_blocks)
    # the first unit a sliding buffer moves is head 0 of page 45's first token, on both sides
    first = req.layer_first_block[0]
    assert req.src_blocks[first] == 45 * 16 * 2 and req.dst_blocks[first] == 545 * 16 * 4
    # every layer sliding: the pages before the window are dropped from the request
    all_sliding = windowed.request(7, list(range(40, 50)), slice(40, 50), True, _windows({0: 63, 1: 63}, 2))
    assert all_sliding.layer_first_block is None and list(all_sliding.src_blocks) == list(full.src_blocks[first:])


def test_the_forward_plans_each_chunk_with_its_windows():
    """The layer-wise plan of an 800-token prompt in chunks of 256, pages of 16, to a
    destination of 50 pages: sliding buffers skip the pages before page 45 in every
    chunk, and SGLang's send() after each forward still finds nothing left."""
    from torch_kvops.integrations.sglang.layerwise import LayerwisePrefill

    page, prompt, room = 16, 800, 3
    dest = Destination("peer", "tcp://d", np.arange(500, 550), 0, "d1", windowed=True)
    manager = NS(ready_destinations=lambda r: [dest], counts=NS(add=lambda *a: None))
    plan = LayerwisePrefill(manager, page, num_buffers=4)
    plan.windows = _windows({0: 63, 1: -1}, 2)
    plan.track("rid", room, prompt)
    req_to_token = torch.arange(1024).reshape(1, 1024)
    moved = {buffer: [] for buffer in range(4)}
    for start in range(0, prompt, 256):
        batch = NS(rids=["rid"], req_pool_indices=torch.tensor([0]), extend_prefix_lens_cpu=[start],
                   extend_seq_lens_cpu=[min(256, prompt - start)])
        for req in plan.plan(batch, req_to_token):
            for buffer in range(4):
                moved[buffer] += list(req.dst_blocks)[req.first_block(buffer):]
    assert moved[1] == moved[3] == list(range(500, 550))
    assert moved[0] == moved[2] == list(range(545, 550))
    pages = req_to_token[0, 0:prompt:page].numpy() // page
    assert plan.hand_off(room, pages, slice(0, len(pages)))[0].size == 0 and plan.pushed_last(room)


def test_no_two_sends_to_one_endpoint_overlap_the_sockets_lookup_included():
    """SGLang closes a socket it finds disconnected under one lock while another thread
    sends on it under another, and libzmq aborts the process (serial_sends.py). With
    the mixin, at most one thread is inside SGLang's send to an endpoint at a time;
    sends to other endpoints go on (seen red without it: 4 threads inside at once)."""
    from torch_kvops.integrations.sglang.serial_sends import SerialSends

    inside: Dict[str, int] = {}
    most: Dict[str, int] = {}
    guard = threading.Lock()

    class SGLangManager:  # stands in for CommonKVManager's method: lookup, then send
        def _send_multipart_locked(self, endpoint, parts, is_ipv6=False):
            with guard:
                inside[endpoint] = inside.get(endpoint, 0) + 1
                most[endpoint] = max(most.get(endpoint, 0), inside[endpoint])
            time.sleep(0.01)
            with guard:
                inside[endpoint] -= 1

    class Manager(SerialSends, SGLangManager):
        pass

    manager = Manager()
    threads = [threading.Thread(target=lambda e=e: [manager._send_multipart_locked(e, [b"x"]) for _ in range(5)])
               for e in ("tcp://a", "tcp://a", "tcp://a", "tcp://a", "tcp://b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most == {"tcp://a": 1, "tcp://b": 1}


def test_a_hybrid_pools_window_is_a_transfer_of_its_own_into_the_window_pages_only():
    """The decode rank's window ids (past its full pool's) go in its destination; the
    prefill's window request names the same count, moves none of it in the full
    layers' buffers, and a window of another length fails the room (ValueError)."""
    kv_args = NS(state_types=[NS(value="swa")])
    window = window_pages(kv_args, [np.array([3, 4])], base=100)
    assert window.tolist() == [103, 104] and window_pages(NS(state_types=[]), [np.array([3])], 100) is None
    assert window_pages(kv_args, None, 100) is None
    frame = window_ids_frame(window)
    dest = destination(None, None, "peer", "tcp://d", np.array([5, 6, 7]), 0, "d0",
                       window=np.frombuffer(frame, dtype=np.int64), sliding=range(4, 6))
    assert dest.transfers(9) == ["9@d0", "9@d0/window"]
    request = dest.window_request(9, [40, 41])
    assert (request.req_id, request.src_blocks, request.dst_blocks) == ("9@d0/window", [40, 41], [103, 104])
    assert request.layer_first_block == {0: 2, 1: 2, 2: 2, 3: 2} and request.last_chunk
    # the room's pages: the sliding buffers (4 and 5) move none of them
    pages = dest.request(9, [1, 2], slice(0, 2), last=False)
    assert pages.dst_blocks == [5, 6] and pages.layer_first_block == {4: 2, 5: 2}
    with pytest.raises(ValueError, match="window of room 9 is 3 pages, decode rank d0's 2"):
        dest.window_request(9, [40, 41, 42])
    plain = destination(None, None, "peer", "tcp://d", np.array([5]), 0, "d0")
    assert plain.transfers(9) == ["9@d0"] and plain.window_request(9, [40]) is None
    assert plain.request(9, [1], slice(0, 1), last=True).layer_first_block is None
    heads = RankHeads(2, 1, 0, 16)
    with pytest.raises(ValueError, match="moved by page only"):
        destination(heads, {"total": 2, "tp_size": 1, "rank": 0}, "peer", "tcp://d", np.array([5]), 0,
                    "d0", window=window)
