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

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layer_index(name: str) -> int:
    found = _LAYER_INDEX.findall(name)
    if len(found) != 1:
        raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
    return int(found[0])


def block_views(name: str, cache: torch.Tensor, num_blocks: int) -> List[torch.Tensor]:
    """Views of one layer's cache with dim 0 = block and contiguous blocks, which is
    what LayerwiseConnector moves.

    Supported: ``[num_blocks, ...]`` (vLLM's CPU backend: ``[num_blocks, kv_heads,
    block_size, 2 * head_size]``) and ``[2, num_blocks, ...]`` (K and V planes, e.g. the
    flash-attention layout), each with contiguous blocks."""
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
    """One per worker process. ``role`` is "producer" (P) or "consumer" (D)."""

    def __init__(self, settings: KvopsSettings, role: str, num_blocks: int) -> None:
        self.settings, self.role, self.num_blocks = settings, role, num_blocks
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
        self._tid_to_req: Dict[str, str] = {}
        self._last_started: Set[str] = set()  # the last chunk was handed to start_step
        self._outcome: Set[str] = set()  # the producer reported finished or failed
        self._sched_finished: Dict[str, float] = {}  # finished by the scheduler, since
        self._known: Set[str] = set()  # requests with pushes: their blocks wait for us
        # consumer
        self._recv_tid_to_req: Dict[str, str] = {}
        # transfers that ended before their request reached this worker (P was faster
        # than this engine's step): tid -> ok, matched in begin_step
        self._early: "OrderedDict[str, bool]" = OrderedDict()
        self._early_done: Set[str] = set()
        self._early_failed: Set[str] = set()
        self._dead_peers: Dict[str, str] = {}  # consumer engine id -> why add_peer failed
        self._failed_recv: Set[str] = set()
        self.metrics = StatsCollector(role)

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        caches = []
        for name in sorted(kv_caches, key=_layer_index):
            views = block_views(name, kv_caches[name], self.num_blocks)
            self._views[name] = [(len(caches) + i, v) for i, v in enumerate(views)]
            caches.extend(views)
        self._all_views = [iv for name in self._views for iv in self._views[name]]
        self.conn.register_kv_caches(caches)
        log.info("kvops %s: %d attention layers as %d caches of %s", self.role, len(kv_caches),
                 len(caches), tuple(caches[0].shape))

    def peer_info(self) -> dict:
        return self.conn.peer_info()

    # ------------------------------------------------------------------ per step

    def begin_step(self, meta: KvopsConnectorMetadata) -> None:
        if self.role == "consumer":
            for recv in meta.recv:
                early = self._early.pop(recv.transfer_id, None)
                if early is None:
                    self._recv_tid_to_req[recv.transfer_id] = recv.req_id
                    self.conn.expect(recv.transfer_id)
                    log.debug("expecting %s at %.4f", recv.transfer_id, time.monotonic())
                else:
                    (self._early_done if early else self._early_failed).add(recv.req_id)
            return
        requests, modes = [], set()
        for push in meta.push:
            self._known.add(push.req_id)
            peer = self._peer(push.peer_info)
            if peer is None:  # decode side unreachable: the request's push failed
                self._outcome.add(push.req_id)
                self.metrics.count("failed_decode_unreachable")
                continue
            self._tid_to_req[push.transfer_id] = push.req_id
            if push.last_chunk:
                self._last_started.add(push.req_id)
            requests.append(TransferRequest(push.transfer_id, peer, push.src_blocks,
                                            push.dst_blocks, last_chunk=push.last_chunk))
            modes.add(push.push_mode)
        if requests:
            log.debug("start_step %s at %.4f", [r.req_id for r in requests], time.monotonic())
            self._step_started = time.monotonic()
            self.conn.start_step(requests)
            # one mode per step: a step holding any after-forward request pushes after
            # the forward (a per-request split would need two steps' worth of pushes)
            self._step_mode = "after_forward" if "after_forward" in modes else "layerwise"
            self._step_tids = [r.req_id for r in requests]

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
            recving, bad = self._early_done | self._early_failed, set(self._early_failed)
            self._early_done, self._early_failed = set(), set()
            for tid in done | failed:
                req_id = self._recv_tid_to_req.pop(tid, None)
                if req_id is None:
                    self._early[tid] = tid in done
                    if len(self._early) > 10_000:  # a transfer no request here ever claims
                        dropped, _ = self._early.popitem(last=False)
                        log.warning("transfer %s ended but no request here claimed it", dropped)
                    continue
                log.debug("transfer %s landed (%s) at %.4f", tid, "ok" if tid in done else "failed",
                          time.monotonic())
                recving.add(req_id)
                if tid in failed:
                    bad.add(req_id)
            return set(), recving, bad
        for tid in done | failed:
            req_id = self._tid_to_req.pop(tid, None)
            if req_id is not None:
                self._outcome.add(req_id)
                if tid in failed:
                    log.warning("push of request %s (transfer %s) failed", req_id, tid)
        now = time.monotonic()
        for req_id in set(finished_req_ids) & self._known:
            self._sched_finished.setdefault(req_id, now)
        # Blocks may be freed once the scheduler finished the request and no push can
        # still read them: the producer reported it, or its last chunk was never started
        # (aborted mid-prefill: every started step already returned; a write of it that
        # failed may still read its source late, hence the quarantine).
        quarantine = self.conn.config.quarantine_s
        sending = {r for r, since in self._sched_finished.items()
                   if r in self._outcome or (r not in self._last_started and now - since >= quarantine)}
        for req_id in sending:
            del self._sched_finished[req_id]
        self._outcome -= sending
        self._last_started -= sending
        self._known -= sending
        return sending, set(), set()

    def connector_stats(self) -> Optional[KvopsConnectorStats]:
        """This interval's metrics (None if nothing happened): metrics.py."""
        return self.metrics.take(self.conn.stats)

    def close(self) -> None:
        try:
            self.conn.close()
        finally:
            self.transport.close()
