"""The send path (prefill side).

    model writes layer i's KV -> save_kv_layer(i): record_layer_event + push_layer
      -> sender thread: LayerEvents.next_ready() -> wait(i) on the layer's own event
      -> PeerLink.write_layer (merged descriptors or staging, per peer, bounded retries)
      -> after the step's last layer: control notice "chunk landed" per request
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from .. import ops
from ..control import ControlClient, derived_secret
from ..events import LayerEvents
from ..plan import KVLayout, StepPlan, TransferRequest, layer_descriptors, validate_step
from ..staging import ProducerStaging, StagingGrant
from ..tls import TlsFiles
from ..transports.base import Transport
from .config import PROTOCOL_VERSION, ConnectorConfig
from .digest_pipeline import DigestPipeline
from .integrity import make_digester, stronger_mode
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


class ProducerSide:
    """Peers, steps and the sender thread of a producer connector."""

    def __init__(self, engine_id: str, caches: Sequence[torch.Tensor], layout: KVLayout,
                 transport: Transport, config: ConnectorConfig, ledger: RequestLedger,
                 stats: ConnectorStats, can_stage: bool, fleet_key: Optional[bytes] = None,
                 tls: Optional[TlsFiles] = None) -> None:
        self._engine_id = engine_id
        self._caches = list(caches)
        self._layout = layout
        self._transport = transport
        self._config = config
        self._ledger = ledger
        self._stats = stats
        self._can_stage = can_stage
        self._fleet_key = fleet_key
        self._tls = tls.client_context() if tls is not None else None
        self._peers: Dict[str, PeerLink] = {}
        self._events = LayerEvents(len(caches), caches[0].device)
        for i, cache in enumerate(self._caches):
            self._events.bind(i, cache)
        self._steps: "queue.Queue[Optional[_Step]]" = queue.Queue()
        self._current: Optional[_Step] = None
        self._last_trace: List[dict] = []
        self._stop = threading.Event()
        self._sender_error: Optional[BaseException] = None
        self._digests = DigestPipeline(stats)  # integrity digests, overlapped with the writes
        self._sender = threading.Thread(target=self._sender_main, name="kvops-sender", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ peers

    def add_peer(self, info: dict) -> str:
        if info.get("version") != PROTOCOL_VERSION:
            raise ValueError(f"peer speaks protocol {info.get('version')}, this side {PROTOCOL_VERSION}")
        if info.get("transport") != self._transport.name:
            raise ValueError(f"peer uses transport {info.get('transport')!r}, this side "
                             f"{self._transport.name!r}")
        if self._fleet_key is not None:
            if info.get("auth") != "fleet":
                raise ValueError(f"consumer {info.get('engine_id')!r} has no fleet key (its peer_info "
                                 "carries its own secret): give every engine of the fleet the same key")
            # derived, never sent (the consumer's proof in the handshake tells whether
            # it derives the same one)
            secret = derived_secret(self._fleet_key, str(info.get("engine_id")))
        else:
            secret = info.get("secret")
            if not isinstance(secret, str) or not secret:
                raise ValueError("peer_info has no 'secret': pass the consumer's peer_info() "
                                 "unchanged, or give both sides the same fleet key (its "
                                 "peer_info says \"auth\": \"fleet\")")
        layout = KVLayout.from_json(info["layout"])
        self._layout.check_compatible(layout)
        with self._ledger.lock:
            known = self._peers.get(info["engine_id"])
            busy = known is not None and known.peer_id in self._ledger.in_flight.values()
        if known is not None and not known.dead:
            if known.data_address != info["data_address"] or known.layout != layout:
                raise ValueError(f"peer {known.peer_id!r} is already known with another address "
                                 "or layout")
            return known.peer_id  # the same peer again (e.g. per-request peer_info)
        if known is not None:
            if busy:
                raise RuntimeError(f"peer {known.peer_id!r} still has requests in flight")
            known.close()
        control = ControlClient(info["control_address"], timeout_s=self._config.control_timeout_s,
                                retries=self._config.max_retries,
                                backoff_s=self._config.retry_backoff_s, tls=self._tls)
        control.connect()
        # Mutual: we prove we know the secret, and refuse a consumer that cannot prove it.
        welcome = control.handshake(secret, self._engine_id, self._can_stage)
        peer = PeerLink(info["engine_id"], layout, info["data_address"], control, self._transport,
                        self._config, self._stats, self._stop)
        grant = welcome.get("staging")
        peer.stage_every_layer = not self._config.direct_device_reads and (
            self._caches[0].device.type == "cuda" or info.get("device") == "cuda")
        if peer.stage_every_layer and not (grant and self._can_stage):
            peer.close()
            raise ValueError(f"peer {info['engine_id']!r}: device caches need staging (every "
                             "layer's blocks must share one block shape and dtype on both sides), "
                             "or ConnectorConfig(direct_device_reads=True) where the transport "
                             "reads device memory without a host copy (RDMA with GPUDirect)")
        mode = stronger_mode(self._config.integrity_mode, welcome.get("integrity") or "off")
        if mode != "off":
            try:
                peer.digester = make_digester(mode, self._caches, secret)
            except ValueError:
                peer.close()
                raise
        if grant and self._can_stage:
            peer.staging = ProducerStaging(self._caches, self._transport, StagingGrant(**grant),
                                           copy_timeout_s=self._config.event_timeout_s)
        with self._ledger.lock:
            self._peers[peer.peer_id] = peer
        return peer.peer_id

    # ------------------------------------------------------------------ step (engine thread)

    def start_step(self, requests: Iterable[TransferRequest]) -> None:
        self.raise_sender_error()
        if self._current is not None and not self._current.done.is_set():
            raise RuntimeError("the previous step is still sending: call wait_for_save() first")
        requests = list(requests)
        with self._ledger.lock:
            peers = {pid: p.layout for pid, p in self._peers.items()}
            plan = validate_step(requests, self._layout, peers, self._ledger.in_flight)
            outcome = {req.req_id: self._ledger.outcome_locked(req.req_id) for req in requests}
            again = [r for r, ok in outcome.items() if ok]
            if again:
                raise ValueError(f"request(s) {again} were already reported finished: a request's "
                                 "chunks end with its last_chunk=True one, and an id is sent once")
            # Later chunks of a request already reported failed (its peer died, the consumer
            # refused it): nothing is written and nothing reported again, so an engine that
            # frees blocks on failure frees them once. The failure report stands.
            late = {r for r, ok in outcome.items() if ok is False}
            if late:
                log.info("dropping later chunks of requests already reported failed: %s", sorted(late))
                self._stats.add(chunks_after_failure=len(late))
                plan.drop(late)
            for req in plan.requests:
                self._ledger.in_flight[req.req_id] = req.peer
        # Pushes of a forward that ran without a step would be taken for this step's.
        while self._events.next_ready(timeout=0) is not None:
            self._stats.add(orphan_pushes=1)
        step = _Step(plan)
        self._current = step
        self._steps.put(step)

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        ops.record_layer_event(kv_cache, self._events.handle, layer)
        ops.push_layer(kv_cache, self._events.handle, layer)

    def wait_for_save(self, timeout: Optional[float]) -> None:
        step = self._current
        if step is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not step.done.wait(0.1):
            self.raise_sender_error()
            if not self._sender.is_alive():
                raise RuntimeError("the sender thread is not running (connector closed?)")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"step not finished sending after {timeout} s")
        self.raise_sender_error()

    def last_step_trace(self) -> List[dict]:
        return list(self._last_trace)

    def raise_sender_error(self) -> None:
        if self._sender_error is not None:
            raise RuntimeError("the sender thread failed") from self._sender_error

    # ------------------------------------------------------------------ sender thread

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
                            # a retried write's first attempt may still land late
                            delay = self._config.quarantine_s if peer_id in step.retried_peers else 0.0
                            self._ledger.report(req.req_id, ok=True, delay=delay)
                        continue
                    except PeerFailed as exc:
                        step.failed_peers[peer_id] = str(exc)
                self._notify_failed(peer, req.req_id, step.failed_peers[peer_id])
                self._stats.add(failed_push=1)
                self._ledger.report(req.req_id, ok=False, delay=self._config.quarantine_s)

    def _notify_failed(self, peer: PeerLink, req_id: str, reason: Optional[str]) -> None:
        """Best effort: a broken channel fails at once (its socket is closed), and the
        consumer's lease covers a notice that never arrives."""
        try:
            peer.send({"op": "failed", "req": req_id, "reason": reason})
        except PeerFailed:
            log.warning("failure notice for %s not delivered to %s: %s", req_id, peer.peer_id, peer.dead)

    def _fail_step(self, step: _Step, reason: str) -> None:
        log.error("step failed: %s", reason)
        for peer_id in step.plan.by_peer:
            step.failed_peers.setdefault(peer_id, reason)
        self._finish_step(step)

    def abort(self, req_id: str, reason: str) -> bool:
        """Engine thread, between steps: fail an in-flight request whose remaining
        chunks will never be sent (the engine dropped it), telling its consumer now
        rather than at lease expiry. False if it is not in flight (never started, or
        its outcome is decided already)."""
        if self._current is not None and not self._current.done.is_set():
            raise RuntimeError("abort while a step is sending: call wait_for_save() first")
        return self._abort(req_id, reason)

    def _abort(self, req_id: str, reason: str) -> bool:
        with self._ledger.lock:
            peer_id = self._ledger.in_flight.get(req_id)
            peer = self._peers.get(peer_id) if peer_id is not None else None
        if peer_id is None:
            return False
        if peer is not None and not peer.dead:
            self._notify_failed(peer, req_id, reason)
        self._stats.add(failed_aborted=1)
        self._ledger.report(req_id, ok=False)
        return True

    def _fail_all_in_flight(self, reason: str) -> None:
        with self._ledger.lock:
            pending = list(self._ledger.in_flight)
        for req_id in pending:
            self._abort(req_id, reason)

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float) -> List[str]:
        """Stop the sender, fail what is in flight, release every peer. Returns the
        problems met (every release is attempted even if one fails)."""
        problems = []
        self._stop.set()
        self._events.close()  # wakes a sender blocked in next_ready
        self._steps.put(None)
        self._sender.join(timeout)
        if self._sender.is_alive():
            problems.append("the sender thread did not stop within the close timeout")
        self._digests.close(wait=not self._sender.is_alive())
        self._fail_all_in_flight("connector closed")
        with self._ledger.lock:
            peers = list(self._peers.values())
        for peer in peers:
            try:
                peer.close()
            except (OSError, RuntimeError) as exc:
                problems.append(f"release failed: {exc}")
        return problems
