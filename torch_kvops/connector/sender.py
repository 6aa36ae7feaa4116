"""The producer's sender thread: it takes each step from the engine thread's queue,
writes every layer to its peers as the layer's KV write completes, and sends the
notices that follow the writes.

    sender thread: LayerEvents.next_ready() -> wait(i) on the layer's own event
      -> PeerLink.write_layer (merged descriptors or staging, per peer, bounded retries)
      -> after the step's last layer: control notice "chunk landed" per request

A part of :class:`~torch_kvops.connector.producer.ProducerSide`, kept apart because it
is one job and one thread: it reads the connector's peers, layer events and step queue.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from ..events import LayerEvents
from ..plan import KVLayout, StepPlan, layer_descriptors
from .config import ConnectorConfig
from .digest_pipeline import DigestPipeline
from .ledger import ConnectorStats, RequestLedger
from .peer import PeerFailed, PeerLink

log = logging.getLogger(__name__)


@dataclass
class _Step:
    plan: StepPlan
    done: threading.Event = field(default_factory=threading.Event)
    failed_peers: Dict[str, Optional[str]] = field(default_factory=dict)
    retried_peers: Set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)



class StepSender:
    """The sender thread of a producer connector (mixed into ProducerSide)."""

    # set by ProducerSide.__init__
    _caches: List[torch.Tensor]
    _layout: KVLayout
    _config: ConnectorConfig
    _ledger: RequestLedger
    _stats: ConnectorStats
    _peers: Dict[str, PeerLink]
    _events: LayerEvents
    _steps: "queue.Queue[Optional[_Step]]"
    _last_trace: List[dict]
    _stop: threading.Event
    _sender_error: Optional[BaseException]
    _digests: DigestPipeline

    def _fail_all_in_flight(self, reason: str) -> None:
        raise NotImplementedError  # ProducerSide's

    def _sender_main(self) -> None:
        try:
            if self._caches[0].device.type == "cuda":
                # CUDA calls from this thread then never touch (and create a context on)
                # another GPU than the caches'.
                torch.cuda.set_device(self._caches[0].device)
            while not self._stop.is_set():
                try:
                    step = self._steps.get(timeout=0.1)
                except queue.Empty:
                    self._handle_revokes(None)
                    continue
                if step is None:
                    break
                try:
                    self._run_step(step)
                finally:
                    step.done.set()
        except BaseException as exc:  # reported to the caller, never swallowed
            log.exception("sender thread failed")
            self._sender_error = exc
            self._fail_all_in_flight(f"sender thread failed: {exc}")
        finally:
            while True:  # nobody will run these: release their waiters
                try:
                    left = self._steps.get_nowait()
                except queue.Empty:
                    break
                if left is not None:
                    left.done.set()

    def _run_step(self, step: _Step) -> None:
        self._stats.add(steps=1)
        self._fail_refused(step)
        self._begin_step(step)
        by_layer = self._step_descriptors(step)
        trace: List[dict] = []
        remaining = set(range(len(self._caches)))
        deadline = step.started + self._config.step_timeout_s
        lookahead: Optional[Tuple[int, float]] = None  # (layer, taken) popped one layer early
        try:
            while remaining:
                if self._stop.is_set():
                    self._fail_step(step, "connector closed during the step")
                    return
                if lookahead is not None:
                    (layer, t0), lookahead = lookahead, None
                else:
                    layer = self._events.next_ready(timeout=0.05)
                    t0 = time.perf_counter()
                    if layer is None:
                        if self._handle_revokes(step):
                            by_layer = self._step_descriptors(step)
                        if time.monotonic() > deadline:
                            self._fail_step(step, f"layers {sorted(remaining)} not pushed within "
                                                  f"{self._config.step_timeout_s} s")
                            return
                        continue
                    if layer not in remaining:
                        self._stats.add(orphan_pushes=1)
                        continue
                if not self._events.wait(layer, timeout=self._config.event_timeout_s):
                    self._fail_step(step, f"layer {layer}'s event did not complete")
                    return
                t1 = time.perf_counter()
                if self._handle_revokes(step):
                    by_layer = self._step_descriptors(step)
                lookahead, prefetch = self._peek_next(remaining - {layer})
                staged = []
                for peer_id, blocks, descriptors in by_layer(layer):
                    if peer_id not in step.failed_peers and not self._stop.is_set():
                        staged.append(self._write_layer(step, self._peers[peer_id], layer, blocks,
                                                        descriptors, prefetch))
                        self._digest_layer(step, peer_id, layer)
                self._digests.send_ready(step.failed_peers)  # those of earlier layers, if done
                t2 = time.perf_counter()
                self._stats.layer(layer, t1 - t0, t2 - t1)
                staged = [t for t in staged if t is not None]
                trace.append({"layer": layer, "pushed": self._events.pushed_at(layer), "taken": t0,
                              "event_ready": t1, "staged": max(staged) if staged else None,
                              "landed": t2})
                self._last_trace = trace
                self._stats.add(layers_sent=1)
                remaining.discard(layer)
            self._finish_step(step)
        finally:
            self._digests.discard()  # left only when the step ended in an exception
            for peer_id in step.plan.by_peer:
                self._peers[peer_id].drop_prefetch()

    def _peek_next(self, wanted: Set[int]) -> Tuple[Optional[Tuple[int, float]], Optional[int]]:
        """Take the next pushed layer early, if there is one: (it and when it was taken,
        itself again if its KV write is already complete). A staged peer then gathers
        that layer's first slots while the current layer's last slots are on the wire."""
        layer = self._events.next_ready(timeout=0)
        if layer is None:
            return None, None
        if layer not in wanted:
            self._stats.add(orphan_pushes=1)
            return None, None
        taken = time.perf_counter()
        return (layer, taken), (layer if self._events.wait(layer, timeout=0) else None)

    def _fail_refused(self, step: _Step) -> None:
        """Requests ``start_step`` refused (``partial``): their consumers hear now that
        they failed (a ``begin`` with no block claims the request on this link, so the
        failure notice counts), and they are reported failed: a later chunk is dropped."""
        for req_id, (req, reason) in step.plan.refused.items():
            peer = self._peers.get(req.peer)
            if peer is not None and not peer.dead:
                try:
                    if req_id not in peer.begin({req_id: np.zeros(0, dtype=np.int64)}):
                        self._notify_failed(peer, req_id, f"refused by the producer: {reason}")
                except PeerFailed as exc:
                    log.warning("peer %s: failure of refused request %s not delivered: %s",
                                req.peer, req_id, exc)
            self._stats.add(failed_refused=1)
            self._ledger.report(req_id, ok=False, hold=peer.quarantine() if peer is not None else None)

    def _begin_step(self, step: _Step) -> None:
        """Announce each peer's requests; drop (and fail) those the peer no longer accepts."""
        for peer_id, entries in list(step.plan.by_peer.items()):
            peer = self._peers[peer_id]
            if peer.dead:
                step.failed_peers[peer_id] = peer.dead
                continue
            try:
                rejected = peer.begin({req.req_id: dst for req, _, dst in entries})
            except PeerFailed as exc:
                step.failed_peers[peer_id] = str(exc)
                continue
            if rejected:  # the consumer gave up on them already: write nothing
                log.warning("peer %s no longer accepts %s", peer_id, sorted(rejected))
                self._stats.add(failed_rejected_by_decode=len(rejected))
                for req_id in rejected:
                    self._ledger.report(req_id, ok=False)
                step.plan.drop(rejected)

    def _handle_revokes(self, step: Optional[_Step]) -> bool:
        """Read what consumers sent (between steps, or between a step's layers) and
        stop the requests they revoked: drop them from the step, acknowledge (no write
        of them starts after this), report them failed. True if the step changed."""
        with self._ledger.lock:  # in a step, only its own peers: one read each per layer
            peers = [self._peers[pid] for pid in step.plan.by_peer] if step is not None \
                else list(self._peers.values())
        changed = False
        for peer in peers:
            if peer.dead:
                continue
            peer.poll()
            if not peer.revoked:
                continue
            revoked = peer.acknowledge_revokes()
            entries = step.plan.by_peer.get(peer.peer_id, []) if step is not None else []
            in_step = {req.req_id for req, _, _ in entries} & revoked
            if in_step:
                step.plan.drop(in_step)
                peer.drop_prefetch()  # gathered for the blocks of the old plan
                changed = True
            for req_id in sorted(revoked):
                with self._ledger.lock:
                    ours = self._ledger.in_flight.get(req_id) == peer.peer_id
                if ours:
                    log.warning("peer %s revoked request %s: stopped", peer.peer_id, req_id)
                    self._stats.add(failed_revoked=1)
                    self._ledger.report(req_id, ok=False, hold=peer.quarantine())
        return changed

    def _step_descriptors(self, step: _Step):
        """Per peer, the step's block ids concatenated over requests, so each layer is
        one merged batch per peer."""
        merged = {peer_id: (np.concatenate([s for _, s, _ in entries]),
                            np.concatenate([d for _, _, d in entries]))
                  for peer_id, entries in step.plan.by_peer.items() if entries}

        def for_layer(layer: int):
            for peer_id, (src_blocks, dst_blocks) in merged.items():
                if src_blocks.size:
                    yield peer_id, (src_blocks, dst_blocks), layer_descriptors(
                        self._layout.layers[layer], self._peers[peer_id].layout.layers[layer],
                        src_blocks, dst_blocks)
        return for_layer

    def _write_layer(self, step: _Step, peer: PeerLink, layer: int, blocks, descriptors,
                     prefetch: Optional[int]) -> Optional[float]:
        """Write one layer to one peer; returns when it was staged (None: direct path
        or the peer failed)."""
        try:
            retries, staged_at = peer.write_layer(layer, *blocks, *descriptors, prefetch=prefetch)
        except PeerFailed as exc:
            step.failed_peers[peer.peer_id] = str(exc)
            return None
        if retries:
            step.retried_peers.add(peer.peer_id)
        return staged_at

    def _digest_layer(self, step: _Step, peer_id: str, layer: int) -> None:
        """Integrity check: digest the blocks of ``layer`` just written to the peer, on
        the digest worker while the next layer is written (digest_pipeline.py)."""
        peer = self._peers[peer_id]
        if peer.digester is not None and peer_id not in step.failed_peers:
            sources = {req.req_id: src for req, src, _ in step.plan.by_peer[peer_id]}
            self._digests.submit(peer, layer, sources)

    def _finish_step(self, step: _Step) -> None:
        """Per request: a "chunk landed" notice (all its bytes of this step returned
        from the transport), or a failure notice; the producer reports the outcome."""
        bytes_per_block = sum(layer.block_bytes for layer in self._layout.layers)
        self._digests.send_ready(step.failed_peers, wait=True)  # digests precede chunk notices
        for peer_id, entries in step.plan.by_peer.items():
            peer = self._peers[peer_id]
            for req, src, dst in entries:
                if peer_id not in step.failed_peers:
                    try:
                        # dst: what landed, so a request that fails later can keep it
                        notice = {"op": "chunk", "req": req.req_id, "last": req.last_chunk,
                                  "bytes": int(src.size) * bytes_per_block, "dst": dst.tolist()}
                        peer.send(notice)
                        if req.last_chunk:
                            # a retried write's first attempt may still read its source
                            self._ledger.report(req.req_id, ok=True, hold=peer.quarantine())
                        continue
                    except PeerFailed as exc:
                        step.failed_peers[peer_id] = str(exc)
                self._notify_failed(peer, req.req_id, step.failed_peers[peer_id])
                self._stats.add(failed_push=1)
                self._ledger.report(req.req_id, ok=False, hold=peer.quarantine())

    def _notify_failed(self, peer: PeerLink, req_id: str, reason: Optional[str]) -> None:
        """Best effort: a broken channel fails at once (its socket is closed), and the
        consumer's lease covers a notice that never arrives. Sent once no more writes
        start for the request; ``in_flight`` tells the consumer whether a failed write
        may still land (it then fences the blocks, docs/connector.md)."""
        try:
            peer.send({"op": "failed", "req": req_id, "reason": reason,
                       "in_flight": peer.writes_may_be_in_flight()})
        except PeerFailed:
            log.warning("failure notice for %s not delivered to %s: %s", req_id, peer.peer_id, peer.dead)

    def _fail_step(self, step: _Step, reason: str) -> None:
        log.error("step failed: %s", reason)
        for peer_id in step.plan.by_peer:
            step.failed_peers.setdefault(peer_id, reason)
        self._finish_step(step)
