"""Prefill worker: turns each step's PushReqs into this rank's parts (tp.py), pushes
them layer by layer from vLLM's save_kv_layer, and reports a request's blocks free
(finished_sending) once no push reads them.

A step may push blocks written by earlier steps (a destination that arrived late):
they go with the step's forward, layer by layer, and in a step without a forward
(vLLM runs one when only finished requests wait for their pushes) ``wait_for_save``
pushes every layer the forward did not. On CUDA caches such a push records its layer
event on the current stream after every kernel the engine queued before it, so it
orders after the step that wrote the KV (not run here: no GPU)."""
# house: long because one state machine (parts, outcomes, frees) per vLLM request reads best whole
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Dict, List, Optional, Set, Tuple

from ...heads import part_id, plan_parts
from ...plan import TransferRequest
from .links import DecodeLinks
from .metadata import KvopsConnectorMetadata, KvopsSettings
from .tp import latent_parts
from .worker import KvopsWorker

log = logging.getLogger(__name__)


class ProducerWorker(KvopsWorker):
    """P's worker side, one per tensor-parallel rank."""

    role = "producer"

    def __init__(self, settings: KvopsSettings, num_blocks: int, total_kv_heads: int = 1,
                 tp_rank: int = 0, tp_size: int = 1, latent: bool = False) -> None:
        super().__init__(settings, num_blocks, total_kv_heads, tp_rank, tp_size, latent)
        self._step_mode: Optional[str] = None  # push mode of the running step, if any
        self._step_tids: List[str] = []
        self._step_started = 0.0  # time.monotonic() when the running step was handed over
        self._steps: deque = deque(maxlen=256)  # recent push steps, for recent_steps()
        self._links = DecodeLinks(self.conn, settings, self.metrics)
        # per request id
        self._tid_to_req: Dict[str, str] = {}  # part id -> request id
        self._parts: Dict[str, Set[str]] = {}  # request id -> its parts not yet ended
        self._parts_seen: Dict[str, Set[str]] = {}  # request id -> every part it had
        self._last_started: Set[str] = set()  # the last chunk was handed to start_step
        self._outcome: Set[str] = set()  # the producer reported finished or failed
        self._sched_finished: Dict[str, float] = {}  # finished by the scheduler, since
        self._known: Set[str] = set()  # requests with pushes: their blocks wait for us
        self._step_pushed: Set[int] = set()  # cache indices pushed by the running step
        self._step_reqs: Set[str] = set()  # requests with parts in the running step
        self._released: Set[str] = set()  # holds the scheduler gave up: report them free
        self._to_abort: Set[str] = set()  # finished before their last chunk: abort between steps

    def begin_step(self, meta: KvopsConnectorMetadata) -> None:
        self._released.update(meta.release)
        self._links.release_idle()
        requests, modes = [], set()
        now = time.monotonic()
        for push in meta.push:
            self._known.add(push.req_id)
            if push.finished:  # finished by the scheduler earlier, held for this push
                self._sched_finished.setdefault(push.req_id, now)
            try:
                planned = self._plan(push)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                # the destination came over the side channel: a bad one fails this
                # request alone (D recomputes it when its lease ends)
                log.error("request %s: unusable decode destination, not pushed: %s", push.req_id, exc)
                self.metrics.count("failed_bad_destination")
                planned = []
            parts = self._parts.setdefault(push.req_id, set())
            seen = self._parts_seen.setdefault(push.req_id, set())
            for part in planned:
                if part is None:  # a decode rank unreachable: that part failed
                    self.metrics.count("failed_decode_unreachable")
                    self.metrics.count("requests_failed")  # a transfer that failed, like the connector's
                    # its earlier chunks' parts can never end with a last chunk now: fail
                    # them (between steps), so the request's blocks are freed
                    for tid in list(parts):
                        self.conn.abort(tid, "a decode rank of the request became unreachable")
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
            try:
                # a bad part is refused alone: reported failed, its D told, no later chunk
                refused = self.conn.start_step(requests, partial=True)
            except ValueError as exc:  # ids, which this worker keeps unique: a bug
                self._refuse_step(requests, exc)
                return
            if refused:
                log.error("push parts refused, not pushed (decode recomputes them): %s", refused)
                self.metrics.count("failed_refused_request", len(refused))
            # one mode per step: a step holding any after-forward request pushes after
            # the forward (a per-request split would need two steps' worth of pushes)
            self._step_mode = "after_forward" if "after_forward" in modes else "layerwise"
            self._step_tids = sorted({p.transfer_id for p in meta.push})
            self._step_pushed = set()
            self._step_reqs = {p.req_id for p in meta.push}

    def _plan(self, push) -> List[Optional[TransferRequest]]:
        """This rank's parts of one chunk: per decode rank it sends heads to, the units
        of those heads in the chunk's blocks (None for a rank that cannot be reached)."""
        decode_tp = len(push.peers)
        layouts = {p.get("kv_cache_layout") for p in push.peers}
        if layouts != {self.kv_cache_layout}:  # same block bytes, read in another order
            raise ValueError(f"request {push.req_id}: decode KV cache layout {sorted(map(str, layouts))}, "
                             f"this engine's {self.kv_cache_layout}: engines of a fleet need one "
                             "layout (vLLM's kv_cache_layout, $VLLM_KV_CACHE_LAYOUT)")
        if self.latent or any(p.get("latent") for p in push.peers):
            return self._plan_latent(push)
        by_head = all(p.get("by_head") for p in push.peers) and self._by_head
        if not by_head and (decode_tp != self.tp_size or not self._by_head and self.tp_size != 1):
            raise ValueError(f"request {push.req_id}: different tensor-parallel sizes ({self.tp_size} "
                             f"-> {decode_tp}) need head-addressable caches on both sides")
        out: List[Optional[TransferRequest]] = []
        if not by_head:  # whole blocks, rank to rank
            peer = self._peer(push.peers[self.tp_rank])
            out.append(None if peer is None else TransferRequest(
                self._part_id(push, self.tp_rank), peer, push.src_blocks,
                push.dst_blocks, last_chunk=push.last_chunk))
            return out
        for plan in plan_parts(self.total_kv_heads, self.tp_size, self.tp_rank, decode_tp):
            peer = self._peer(push.peers[plan.decode_rank])
            if peer is None:
                out.append(None)
                continue
            src, dst = plan.units(push.src_blocks, push.dst_blocks)
            out.append(TransferRequest(self._part_id(push, plan.decode_rank),
                                       peer, src, dst, last_chunk=push.last_chunk))
        return out

    def _part_id(self, push, decode_rank: int) -> str:
        """This rank's part of ``push`` toward ``decode_rank``, under that rank's nonce."""
        return part_id(push.transfer_id, push.peers[decode_rank]["engine_id"], self.tp_rank, decode_rank)

    def _plan_latent(self, push) -> List[Optional[TransferRequest]]:
        """MLA: this rank's share of the chunk's blocks for every decode rank (tp.py).
        A part with none of its blocks in this chunk still goes out, empty, so that
        its last chunk ends it and no chunk leaves the request looking finished here."""
        if not (self.latent and all(p.get("latent") for p in push.peers)):
            raise ValueError(f"request {push.req_id}: an MLA (latent) cache on one side only")
        out: List[Optional[TransferRequest]] = []
        for part in latent_parts(push.total_blocks, self.tp_size, self.tp_rank, len(push.peers)):
            peer = self._peer(push.peers[part.decode_rank])
            if peer is None:
                out.append(None)
                continue
            src, dst = part.chunk(push.block_offset, push.src_blocks, push.dst_blocks)
            out.append(TransferRequest(self._part_id(push, part.decode_rank),
                                       peer, src, dst, last_chunk=push.last_chunk))
        return out

    def close(self) -> None:
        try:
            self._links.close()
        finally:
            super().close()

    def _peer(self, info: dict) -> Optional[str]:
        """The peer id of a decode rank; None while it cannot be used (links.py)."""
        return self._links.peer(info)

    def save_kv_layer(self, layer_name: str) -> None:
        if self._step_mode != "layerwise":
            return
        for index, view in self._views[layer_name]:
            self._step_pushed.add(index)
            self.conn.save_kv_layer(index, view)

    def wait_for_save(self) -> None:
        if self._step_mode is None:
            return
        forward_done_at = time.monotonic()
        t0 = time.perf_counter()
        try:
            # after-forward mode, or blocks written by earlier steps in a step without
            # a forward: every layer not pushed yet goes now (its KV is written)
            for index, view in self._all_views:
                if index not in self._step_pushed:
                    self.conn.save_kv_layer(index, view)
            self.conn.wait_for_save(timeout=self.settings.save_wait_s())
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
            self._step_reqs = set()

    def recent_steps(self, transfer_id: Optional[str] = None) -> List[dict]:
        """Timings of recent push steps (all, or those carrying ``transfer_id``)."""
        return [s for s in self._steps if transfer_id is None or transfer_id in s["transfer_ids"]]

    # ------------------------------------------------------------------ completion

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str], Set[str]]:
        """(finished_sending, finished_recving, failed_recving) as vLLM request ids: the
        requests whose blocks no push reads any more."""
        done, failed = self.conn.get_finished()
        if done or failed:
            self.metrics.touch()
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
        # Model Runner V2 may collect these before wait_for_save: nothing of the running
        # step is aborted or reported free until it ended (the next call does it)
        stepping = self._step_mode is not None
        for req_id in set(finished_req_ids) & self._known:
            self._sched_finished.setdefault(req_id, now)
            if req_id not in self._last_started:
                self._to_abort.add(req_id)
        if not stepping:
            for req_id in self._to_abort:
                self._abort_parts(req_id)
            self._to_abort.clear()
        # Blocks may be freed once the scheduler finished the request and no push can
        # still read them: the producer reported it, or its last chunk was never started
        # (aborted mid-prefill: every started step already returned; a write of it that
        # failed may still read its source late, hence the quarantine).
        quarantine = self.conn.config.quarantine_s
        sending = {r for r, since in self._sched_finished.items()
                   if r not in self._step_reqs and r not in self._to_abort and (r in self._outcome or (
                       r not in self._last_started and not self._parts.get(r) and now - since >= quarantine))}
        for req_id in sending:
            del self._sched_finished[req_id]
            self._parts_seen.pop(req_id, None)
            for tid in self._parts.pop(req_id, ()):  # aborted before its parts ended
                self._tid_to_req.pop(tid, None)
        self._outcome -= sending
        self._last_started -= sending
        self._known -= sending
        released, self._released = self._released, set()  # never pushed: nothing reads them
        return sending | released, set(), set()

    def _refuse_step(self, requests: List[TransferRequest], exc: ValueError) -> None:
        """The connector refused the step's plan (validated before anything moved, e.g.
        two requests naming the same destination block after the decode side reused a
        block): the step pushes nothing and its requests fail, so their decode sides
        recompute them, instead of the engine dying on a worker error."""
        log.error("push step refused, its %d parts are not pushed (decode recomputes them): %s",
                  len(requests), exc)
        self.metrics.count("failed_refused_step", len(requests))
        for part in requests:
            if self.conn.abort(part.req_id, f"the prefill side refused the step: {exc}"):
                continue  # in flight: its failure comes back through get_finished
            req_id = self._tid_to_req.pop(part.req_id, None)
            parts = self._parts.get(req_id) if req_id is not None else None
            if parts is not None:
                parts.discard(part.req_id)
                if not parts:
                    del self._parts[req_id]
                    self._outcome.add(req_id)

    def _abort_parts(self, req_id: str) -> None:
        """Producer: the scheduler finished the request before its last chunk (aborted,
        e.g. while preempted): its decode ranks learn now, not at lease expiry. No step
        is sending (get_finished runs after wait_for_save); a part that a slow decode
        rank's lane still writes alone starts no write after the abort, and its failure
        (so the blocks' release) comes once the write under way returned."""
        parts = self._parts.get(req_id)
        for tid in list(parts or ()):
            # an aborted part's failure comes back through get_finished once no transfer
            # it left behind can read its source (the connector's quarantine)
            if not self.conn.abort(tid, "the prefill engine finished the request before its last chunk") \
                    and self.conn.outcome(tid) is None:  # never started: nothing reads for it
                parts.discard(tid)
                self._tid_to_req.pop(tid, None)
        if parts is not None and not parts:
            del self._parts[req_id]
            self._outcome.add(req_id)
