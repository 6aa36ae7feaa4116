"""Worker side: registers vLLM's KV caches with a LayerwiseConnector and drives it
from vLLM's hooks (bind_connector_metadata -> start_step / expect, save_kv_layer -> the
layer-wise push ops, wait_for_save, get_finished)."""
from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict, deque
from typing import Dict, List, Optional, Set, Tuple

import torch

from ...connector import LayerwiseConnector
from ...plan import TransferRequest
from ...transports import MooncakeTransport
from .metadata import KvopsConnectorMetadata, KvopsSettings
from .metrics import KvopsConnectorStats, StatsCollector
from .tp import expected_parts, part_id, plan_parts, rank_heads

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layer_index(name: str) -> int:
    found = _LAYER_INDEX.findall(name)
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
    return int(found[0])


def block_views(name: str, cache: torch.Tensor, num_blocks: int,
                local_heads: Optional[int] = None) -> List[torch.Tensor]:
    """Views of one layer's cache with dim 0 = transfer unit and contiguous units, which
    is what LayerwiseConnector moves.

    Supported: ``[num_blocks, kv_heads, ...]`` contiguous (vLLM's CPU backend:
    ``[num_blocks, kv_heads, block_size, 2 * head_size]``), moved by KV head of a block
    (``[num_blocks * kv_heads, ...]``, tp.py) when ``local_heads`` names dim 1; and
    ``[num_blocks, ...]`` or ``[2, num_blocks, ...]`` (K and V planes, e.g. the
    flash-attention layout) with contiguous blocks, moved by whole blocks (equal
    tensor parallelism only: a head range of a block is not contiguous there)."""
    if (local_heads is not None and cache.dim() >= 3 and cache.size(0) == num_blocks
            and cache.size(1) == local_heads and cache.is_contiguous()):
        return [cache.view(num_blocks * local_heads, *cache.shape[2:])]
    if cache.dim() >= 2 and cache.size(0) == num_blocks and cache[0].is_contiguous():
        return [cache]
    if (cache.dim() >= 3 and cache.size(0) == 2 and cache.size(1) == num_blocks
            and cache[0, 0].is_contiguous() and cache[1, 0].is_contiguous()):
        return [cache[0], cache[1]]
    raise ValueError(
        f"KV cache {name!r}: unsupported layout shape={tuple(cache.shape)} "
        f"stride={cache.stride()} for {num_blocks} blocks; KvopsLayerwiseConnector needs "
        "[num_blocks, ...] or [2, num_blocks, ...] with each block contiguous")


class KvopsWorker:
    """One per worker process (one per tensor-parallel rank). ``role`` is "producer"
    (P) or "consumer" (D); ``total_kv_heads`` is the model's, ``tp_rank``/``tp_size``
    this engine's."""

    def __init__(self, settings: KvopsSettings, role: str, num_blocks: int, total_kv_heads: int = 1,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.settings, self.role, self.num_blocks = settings, role, num_blocks
        self.total_kv_heads, self.tp_rank, self.tp_size = total_kv_heads, tp_rank, tp_size
        self.heads = rank_heads(total_kv_heads, tp_size, tp_rank)
        self._by_head = False  # units are heads of blocks (tp.py), else whole blocks
        self.transport = MooncakeTransport(host=settings.host)
        try:
            self.conn = LayerwiseConnector(role, self.transport, settings.connector_config())
        except BaseException:
            self.transport.close()
            raise
        self._views: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
        self._all_views: List[Tuple[int, torch.Tensor]] = []
        self._step_mode: Optional[str] = None  # push mode of the running step, if any
        self._step_tids: List[str] = []
        self._step_started = 0.0  # time.monotonic() when the running step was handed over
        self._steps: deque = deque(maxlen=256)  # recent push steps, for recent_steps()
        self._peers: Dict[str, str] = {}  # consumer engine id -> peer id
        # producer: per request id
        self._tid_to_req: Dict[str, str] = {}  # part id -> request id
        self._parts: Dict[str, Set[str]] = {}  # request id -> its parts not yet ended
        self._parts_seen: Dict[str, Set[str]] = {}  # request id -> every part it had
        self._last_started: Set[str] = set()  # the last chunk was handed to start_step
        self._outcome: Set[str] = set()  # the producer reported finished or failed
        self._sched_finished: Dict[str, float] = {}  # finished by the scheduler, since
        self._known: Set[str] = set()  # requests with pushes: their blocks wait for us
        # consumer
        self._recv_tid_to_req: Dict[str, str] = {}  # part id -> request id
        self._recv_left: Dict[str, Set[str]] = {}  # request id -> parts not yet ended
        self._recv_bad: Set[str] = set()  # requests with a failed part
        self._recv_blocks: Dict[str, List[int]] = {}  # request id -> the blocks P fills
        # request id -> blocks every failed part of it filled (absent: no part failed)
        self._recv_valid: Dict[str, Set[int]] = {}
        self._part_valid: "OrderedDict[str, Set[int]]" = OrderedDict()  # failed early part -> ...
        self._load_errors: Set[int] = set()  # blocks to report as not loaded (partial failure)
        # transfers that ended before their request reached this worker (P was faster
        # than this engine's step): tid -> ok, matched in begin_step
        self._early: "OrderedDict[str, bool]" = OrderedDict()
        self._ended_ok: Set[str] = set()
        self._ended_failed: Set[str] = set()
        self._dead_peers: Dict[str, str] = {}  # consumer engine id -> why add_peer failed
        self._failed_recv: Set[str] = set()
        self.metrics = StatsCollector(role)

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        caches = []
        first = kv_caches[min(kv_caches, key=_layer_index)]
        self._by_head = (first.dim() >= 3 and first.size(0) == self.num_blocks
                         and first.size(1) == len(self.heads) and first.is_contiguous())
        if not self._by_head and self.tp_size > 1:
            raise ValueError(f"KV cache layout shape={tuple(first.shape)}: tensor parallelism needs "
                             "[num_blocks, kv_heads, ...] with contiguous blocks (a head range of a "
                             "block must be contiguous to move it between ranks)")
        for name in sorted(kv_caches, key=_layer_index):
            views = block_views(name, kv_caches[name], self.num_blocks,
                                len(self.heads) if self._by_head else None)
            self._views[name] = [(len(caches) + i, v) for i, v in enumerate(views)]
            caches.extend(views)
        self._all_views = [iv for name in self._views for iv in self._views[name]]
        self.conn.register_kv_caches(caches)
        log.info("kvops %s: %d attention layers as %d caches of %s", self.role, len(kv_caches),
                 len(caches), tuple(caches[0].shape))

    def peer_info(self) -> dict:
        """This rank's consumer peer_info, with its tensor-parallel rank and how its
        units address heads."""
        return dict(self.conn.peer_info(), tp_rank=self.tp_rank, tp_size=self.tp_size,
                    by_head=self._by_head)

    # ------------------------------------------------------------------ per step

    def begin_step(self, meta: KvopsConnectorMetadata) -> None:
        if self.role == "consumer":
            for recv in meta.recv:
                self._expect(recv.req_id, recv.transfer_id, recv.prefill_tp, recv.block_ids)
            return
        requests, modes = [], set()
        for push in meta.push:
            self._known.add(push.req_id)
            parts = self._parts.setdefault(push.req_id, set())
            seen = self._parts_seen.setdefault(push.req_id, set())
            for part in self._plan(push):
                if part is None:  # a decode rank unreachable: that part failed
                    self.metrics.count("failed_decode_unreachable")
                    continue
                if part.req_id not in seen:  # an ended part is not waited for again
                    seen.add(part.req_id)
                    parts.add(part.req_id)
                    self._tid_to_req[part.req_id] = push.req_id
                requests.append(part)  # the connector drops chunks of a failed part
            if not parts:  # nothing of it to send from this rank, or nowhere to send it
                self._parts.pop(push.req_id)
                self._outcome.add(push.req_id)
                continue
            if push.last_chunk:
                self._last_started.add(push.req_id)
            modes.add(push.push_mode)
        if requests:
            log.debug("start_step %s at %.4f", [r.req_id for r in requests], time.monotonic())
            self._step_started = time.monotonic()
            self.conn.start_step(requests)
            # one mode per step: a step holding any after-forward request pushes after
            # the forward (a per-request split would need two steps' worth of pushes)
            self._step_mode = "after_forward" if "after_forward" in modes else "layerwise"
            self._step_tids = sorted({p.transfer_id for p in meta.push})

    def _plan(self, push) -> List[Optional[TransferRequest]]:
        """This rank's parts of one chunk: per decode rank it sends heads to, the units
        of those heads in the chunk's blocks (None for a rank that cannot be reached)."""
        decode_tp = len(push.peers)
        by_head = all(p.get("by_head") for p in push.peers) and self._by_head
        if not by_head and (decode_tp != self.tp_size or not self._by_head and self.tp_size != 1):
            raise ValueError(f"request {push.req_id}: different tensor-parallel sizes ({self.tp_size} "
                             f"-> {decode_tp}) need head-addressable caches on both sides")
        out: List[Optional[TransferRequest]] = []
        if not by_head:  # whole blocks, rank to rank
            peer = self._peer(push.peers[self.tp_rank])
            out.append(None if peer is None else TransferRequest(
                part_id(push.transfer_id, self.tp_rank, self.tp_rank), peer, push.src_blocks,
                push.dst_blocks, last_chunk=push.last_chunk))
            return out
        for plan in plan_parts(self.total_kv_heads, self.tp_size, self.tp_rank, decode_tp):
            peer = self._peer(push.peers[plan.decode_rank])
            if peer is None:
                out.append(None)
                continue
            src, dst = plan.units(push.src_blocks, push.dst_blocks)
            out.append(TransferRequest(part_id(push.transfer_id, self.tp_rank, plan.decode_rank),
                                       peer, src, dst, last_chunk=push.last_chunk))
        return out

    def _expect(self, req_id: str, transfer_id: str, prefill_tp: int, block_ids: List[int]) -> None:
        """Consumer: wait for the parts of ``transfer_id`` this rank receives (tp.py)."""
        if prefill_tp <= 0:  # the destination never reached P: nothing will come
            log.warning("request %s: its destination was not accepted by the prefill side", req_id)
            self._ended_failed.add(req_id)
            return
        self._recv_blocks[req_id] = list(block_ids)
        if self._by_head:
            parts = expected_parts(transfer_id, self.total_kv_heads, prefill_tp, self.tp_size,
                                   self.tp_rank)
        else:
            parts = [part_id(transfer_id, self.tp_rank, self.tp_rank)]
        left = self._recv_left[req_id] = set()
        for part in parts:
            early = self._early.pop(part, None)
            if early is None:
                left.add(part)
                self._recv_tid_to_req[part] = req_id
                self.conn.expect(part)
            elif not early:
                self._part_failed(req_id, self._part_valid.pop(part, set()))
        log.debug("expecting %s (%s) at %.4f", transfer_id, parts, time.monotonic())
        if not left:
            self._recv_ended(req_id)

    def _part_failed(self, req_id: str, valid: Set[int]) -> None:
        """A part of the request failed, having filled ``valid`` blocks before."""
        self._recv_bad.add(req_id)
        known = self._recv_valid.get(req_id)
        self._recv_valid[req_id] = valid if known is None else known & valid

    def _valid_blocks(self, landed: List[List[int]]) -> Set[int]:
        """Blocks a failed part filled completely: those of the chunks that landed, but
        the last block of the last one, which a chunk boundary may have cut (the next
        chunk would have pushed it again whole)."""
        if not landed:
            return set()
        per_block = len(self.heads) if self._by_head else 1  # units are heads of blocks
        valid = {unit // per_block for chunk in landed for unit in chunk}
        valid.discard(landed[-1][-1] // per_block)
        return valid

    def _recv_ended(self, req_id: str) -> None:
        """Every part of the request ended here: report it once. If a part failed after
        some of its chunks landed, the request is reported received with the blocks not
        filled as load errors (vLLM keeps the prefix before the first of them and
        recomputes the rest); if nothing usable landed, it is reported failed."""
        del self._recv_left[req_id]
        blocks = self._recv_blocks.pop(req_id, [])
        valid = self._recv_valid.pop(req_id, None)
        if req_id not in self._recv_bad:
            self._ended_ok.add(req_id)
            return
        self._recv_bad.discard(req_id)
        missing = [b for b in blocks if b not in valid]
        if blocks and len(missing) < len(blocks):
            self._load_errors.update(missing)
            self.metrics.count("partial_loads")
            self.metrics.count("load_error_blocks", len(missing))
            self._ended_ok.add(req_id)
        else:
            self._ended_failed.add(req_id)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Consumer: blocks of requests reported received in this step's
        get_finished that a failed transfer did not fill (vLLM recomputes from the
        first of them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _peer(self, info: dict) -> Optional[str]:
        """The peer id of a decode instance, connecting on first use; None if it cannot
        be reached (remembered, so later chunks do not stall the engine again)."""
        engine_id = info["engine_id"]
        peer = self._peers.get(engine_id)
        if peer is None and engine_id not in self._dead_peers:
            try:
                peer = self.conn.add_peer(info)  # bounded by control_timeout_s and retries
            except (ConnectionError, OSError) as exc:
                log.error("decode instance %s unreachable, its requests fail: %s", engine_id, exc)
                self._dead_peers[engine_id] = str(exc)
                return None
            self._peers[engine_id] = peer
        return peer

    def save_kv_layer(self, layer_name: str) -> None:
        if self._step_mode != "layerwise":
            return
        for index, view in self._views[layer_name]:
            self.conn.save_kv_layer(index, view)

    def wait_for_save(self) -> None:
        if self._step_mode is None:
            return
        forward_done_at = time.monotonic()
        t0 = time.perf_counter()
        try:
            if self._step_mode == "after_forward":
                for index, view in self._all_views:
                    self.conn.save_kv_layer(index, view)
            self.conn.wait_for_save(timeout=self.settings.step_timeout_s)
        finally:
            t1 = time.perf_counter()
            log.debug("step %s: forward done %.4f, pushes landed %.4f", self._step_tids,
                      forward_done_at, time.monotonic())
            trace = self.conn.last_step_trace()
            last = max(trace, key=lambda t: t["landed"]) if trace else None
            self._steps.append({
                "transfer_ids": self._step_tids, "push_mode": self._step_mode,
                "started_at": self._step_started, "forward_done_at": forward_done_at,
                # what the engine waited for after its forward: the transfer not hidden
                "exposed_after_forward_s": t1 - t0,
                "last_layer_transfer_s": (last["landed"] - last["event_ready"]) if last else None,
                # first layer's KV ready -> last layer landed: the whole transfer when
                # pushed after the forward
                "push_span_s": (last["landed"] - min(t["event_ready"] for t in trace)) if last else None,
                "layers_pushed": len(trace)})
            self.metrics.on_step(trace, t1 - t0)
            self._step_mode = None

    def recent_steps(self, transfer_id: Optional[str] = None) -> List[dict]:
        """Timings of recent push steps (all, or those carrying ``transfer_id``)."""
        return [s for s in self._steps if transfer_id is None or transfer_id in s["transfer_ids"]]

    # ------------------------------------------------------------------ completion

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str], Set[str]]:
        """(finished_sending, finished_recving, failed_recving) as vLLM request ids."""
        done, failed = self.conn.get_finished()
        if done or failed:
            self.metrics.touch()
        if self.role == "consumer":
            recving, bad = self._ended_ok | self._ended_failed, set(self._ended_failed)
            self._ended_ok, self._ended_failed = set(), set()
            for tid in done | failed:
                req_id = self._recv_tid_to_req.pop(tid, None)
                valid = self._valid_blocks(self.conn.landed_chunks(tid)) if tid in failed else None
                if req_id is None:
                    self._early[tid] = tid in done
                    if valid is not None:
                        self._part_valid[tid] = valid
                    if len(self._early) > 10_000:  # a transfer no request here ever claims
                        dropped, _ = self._early.popitem(last=False)
                        self._part_valid.pop(dropped, None)
                        log.warning("transfer %s ended but no request here claimed it", dropped)
                    continue
                log.debug("transfer %s landed (%s) at %.4f", tid, "ok" if tid in done else "failed",
                          time.monotonic())
                if valid is not None:
                    self._part_failed(req_id, valid)
                left = self._recv_left[req_id]
                left.discard(tid)
                if not left:
                    self._recv_ended(req_id)
            recving |= self._ended_ok | self._ended_failed
            bad |= self._ended_failed
            self._ended_ok, self._ended_failed = set(), set()
            return set(), recving, bad
        for tid in done | failed:
            req_id = self._tid_to_req.pop(tid, None)
            if req_id is not None:
                if tid in failed:
                    log.warning("push of request %s (transfer %s) failed", req_id, tid)
                parts = self._parts.get(req_id)
                if parts is not None:
                    parts.discard(tid)
                    if parts:
                        continue  # other parts of it may still read its blocks
                    del self._parts[req_id]
                self._outcome.add(req_id)
        now = time.monotonic()
        for req_id in set(finished_req_ids) & self._known:
            self._sched_finished.setdefault(req_id, now)
            if req_id not in self._last_started:
                self._abort_parts(req_id)
        # Blocks may be freed once the scheduler finished the request and no push can
        # still read them: the producer reported it, or its last chunk was never started
        # (aborted mid-prefill: every started step already returned; a write of it that
        # failed may still read its source late, hence the quarantine).
        quarantine = self.conn.config.quarantine_s
        sending = {r for r, since in self._sched_finished.items()
                   if r in self._outcome or (r not in self._last_started and now - since >= quarantine)}
        for req_id in sending:
            del self._sched_finished[req_id]
            self._parts_seen.pop(req_id, None)
            for tid in self._parts.pop(req_id, ()):  # aborted before its parts ended
                self._tid_to_req.pop(tid, None)
        self._outcome -= sending
        self._last_started -= sending
        self._known -= sending
        return sending, set(), set()

    def _abort_parts(self, req_id: str) -> None:
        """Producer: the scheduler finished the request before its last chunk (aborted,
        e.g. while preempted): its decode ranks learn now, not at lease expiry. No step
        is sending (get_finished runs after wait_for_save), so an aborted part reads
        none of the blocks the scheduler frees."""
        parts = self._parts.get(req_id)
        for tid in list(parts or ()):
            if self.conn.abort(tid, "the prefill engine finished the request before its last chunk"):
                parts.discard(tid)
                self._tid_to_req.pop(tid, None)
        if parts is not None and not parts:
            del self._parts[req_id]
            self._outcome.add(req_id)

    def connector_stats(self) -> Optional[KvopsConnectorStats]:
        """This interval's metrics (None if nothing happened): metrics.py."""
        return self.metrics.take(self.conn.stats)

    def close(self) -> None:
        try:
            self.conn.close()
        finally:
            self.transport.close()
