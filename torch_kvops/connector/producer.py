"""The send path (prefill side).

    model writes layer i's KV -> save_kv_layer(i): record_layer_event + push_layer
      -> sender thread: LayerEvents.next_ready() -> wait(i) on the layer's own event
      -> PeerLink.write_layer (merged descriptors or staging, per peer, bounded retries)
      -> after the step's last layer: control notice "chunk landed" per request

This file: peers and the engine thread's calls; the sender thread's work: sender.py.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence

import torch

from .. import ops
from ..control import ControlClient, derived_secret
from ..events import LayerEvents
from ..plan import KVLayout, TransferRequest, validate_step
from ..staging import ProducerStaging, StagingGrant
from ..tls import TlsFiles
from ..transports.base import Transport
from .config import PROTOCOL_VERSION, ConnectorConfig
from .digest_pipeline import DigestPipeline
from .integrity import make_digester, stronger_mode
from .ledger import ConnectorStats, RequestLedger
from .peer import PeerLink
from .peer_step import PeerStep, fail_aborted
from .releaser import LinkReleaser, close_links
from .sender import StepSender, _Step

log = logging.getLogger(__name__)


class ProducerSide(StepSender):
    """Peers, steps and the sender thread of a producer connector (the thread's work:
    sender.py)."""

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
        self._connecting: Dict[str, list] = {}  # engine id -> [its lock, callers using it]
        self._tails: Dict[str, PeerStep] = {}  # lanes left to finish alone (sender.py)
        self._events = LayerEvents(len(caches), caches[0].device)
        for i, cache in enumerate(self._caches):
            self._events.bind(i, cache)
        self._steps: "queue.Queue[Optional[_Step]]" = queue.Queue()
        self._current: Optional[_Step] = None
        self._last_trace: List[dict] = []
        self._stop = threading.Event()
        self._sender_error: Optional[BaseException] = None
        self._digests = DigestPipeline(stats)  # integrity digests, overlapped with the writes
        self._releaser = LinkReleaser(stats)  # closes links off the engine's thread
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
        engine_id = info["engine_id"]
        with self._ledger.lock:
            entry = self._connecting.setdefault(engine_id, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:  # one attempt per engine id: a caller meanwhile gets its peer
                return self._connect(info, secret, layout)
        finally:
            with self._ledger.lock:
                entry[1] -= 1
                if not entry[1]:
                    del self._connecting[engine_id]

    def _connect(self, info: dict, secret: str, layout: KVLayout) -> str:
        """add_peer's work, under the engine id's lock: the known live peer, or a new link."""
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
            with self._ledger.lock:
                del self._peers[known.peer_id]
            self._releaser.release(known)  # its buffer may still be read: never waited for here
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
                peer.digester = make_digester(mode, self._caches, secret, id_bases=self._layout.id_bases)
            except ValueError:
                peer.close()
                raise
        if grant and self._can_stage:
            block_bytes = self._caches[0][0].numel() * self._caches[0].element_size()
            try:
                checked = StagingGrant.from_consumer(
                    grant, block_bytes, self._config.staging_slots * self._config.staging_slot_bytes)
            except ValueError:
                peer.close()
                raise
            peer.staging = ProducerStaging(self._caches, self._transport, checked,
                                           copy_timeout_s=self._config.event_timeout_s)
        with self._ledger.lock:
            self._peers[peer.peer_id] = peer
        return peer.peer_id

    def release_peers(self, idle_s: float, keep: Optional[int] = None) -> List[str]:
        """Forget the peers given up on, or not used for ``idle_s``, that have no
        request in flight, and close them in the background (releaser.py: their control
        channel, staging registration and buffer); with ``keep``, also the least
        recently used beyond ``keep`` live peers. Engine thread, between steps: never
        waits on the transport. Returns their ids."""
        now = time.monotonic()
        with self._ledger.lock:
            busy = set(self._ledger.in_flight.values())
            busy |= {pid for pid, lane in list(self._tails.items()) if lane.running}
            free = sorted((peer for pid, peer in self._peers.items() if pid not in busy),
                          key=lambda peer: peer.last_used)  # least recently used first
            stale = {peer.peer_id for peer in free if peer.dead or now - peer.last_used >= idle_s}
            idle = [peer for peer in free if peer.peer_id in stale]
            spare = [peer for peer in free if peer.peer_id not in stale]
            if keep is not None:
                idle += spare[:max(0, len(self._peers) - len(idle) - keep)]
            for peer in idle:
                del self._peers[peer.peer_id]
        for peer in idle:
            self._releaser.release(peer)
        return [peer.peer_id for peer in idle]

    def wait_released(self, timeout: float) -> bool:
        """Wait until the links let go of are closed; True if none is left."""
        return self._releaser.wait_idle(timeout)

    def peer_failed(self, peer_id: str) -> Optional[str]:
        with self._ledger.lock:
            peer = self._peers.get(peer_id)
        if peer is None:
            raise KeyError(f"unknown peer {peer_id!r}")
        return peer.dead

    # ------------------------------------------------------------------ step (engine thread)

    def start_step(self, requests: Iterable[TransferRequest], partial: bool = False) -> Dict[str, str]:
        self.raise_sender_error()
        if self._current is not None and not self._current.done.is_set():
            raise RuntimeError("the previous step is still sending: call wait_for_save() first")
        requests = list(requests)
        with self._ledger.lock:
            peers = {pid: p.layout for pid, p in self._peers.items()}
            plan = validate_step(requests, self._layout, peers, self._ledger.in_flight, partial)
            outcome = {req.req_id: self._ledger.outcome_locked(req.req_id) for req in requests}
            again = [r for r, ok in outcome.items() if ok]
            if again:
                reason = ("already reported finished: a request's chunks end with its "
                          "last_chunk=True one, and an id is sent once")
                if not partial:
                    raise ValueError(f"request(s) {again} were {reason}")
                # a reused id (a client naming its own transfer id twice) fails alone;
                # the ledger keeps the id's first outcome, so each reuse is refused again
                plan.refuse([req for req in requests if req.req_id in again], reason)
            # Later chunks of a request already reported failed (its peer died, the consumer
            # refused it): nothing is written and nothing reported again, so an engine that
            # frees blocks on failure frees them once. The failure report stands.
            late = {r for r, ok in outcome.items() if ok is False}
            if late:
                log.info("dropping later chunks of requests already reported failed: %s", sorted(late))
                self._stats.add(chunks_after_failure=len(late))
                plan.drop(late)
                for req_id in late & set(plan.refused):
                    del plan.refused[req_id]
            for req in plan.requests:
                self._ledger.in_flight[req.req_id] = req.peer
            # refused: failed on the sender thread, which tells their consumers first
            for req_id, (req, _) in plan.refused.items():
                self._ledger.in_flight[req_id] = req.peer
        # Pushes of a forward that ran without a step would be taken for this step's.
        while self._events.next_ready(timeout=0) is not None:
            self._stats.add(orphan_pushes=1)
        step = _Step(plan)
        self._current = step
        self._steps.put(step)
        return {req_id: reason for req_id, (_, reason) in plan.refused.items()}

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

    # ------------------------------------------------------------------ failing requests

    def abort(self, req_id: str, reason: str) -> bool:
        """Engine thread, between steps: fail an in-flight request whose remaining
        chunks will never be sent (the engine dropped it), telling its consumer now
        rather than at lease expiry. False if it is not in flight (never started, or
        its outcome is decided already). A request a lane still writes alone (after
        its step, ``detach_slow_lanes_after_s``) has no write start after this
        returns; the lane reports its failure once its write under way returned, so
        the engine frees its blocks after that."""
        if self._current is not None and not self._current.done.is_set():
            raise RuntimeError("abort while a step is sending: call wait_for_save() first")
        for lane in list(self._tails.values()):
            if lane.running and lane.abort(req_id, reason):
                return True
        return self._abort(req_id, reason)

    def _abort(self, req_id: str, reason: str) -> bool:
        with self._ledger.lock:
            peer_id = self._ledger.in_flight.get(req_id)
            peer = self._peers.get(peer_id) if peer_id is not None else None
        if peer_id is None:
            return False
        fail_aborted(peer, req_id, reason, self._ledger, self._stats)
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
        for lane in list(self._tails.values()):  # they write nothing more once stopped
            lane.join(timeout)
            if lane.running:
                problems.append(f"the lane of peer {lane.peer.peer_id} did not stop within the "
                                "close timeout")
        self._digests.close(wait=not self._sender.is_alive())
        self._fail_all_in_flight("connector closed")
        problems += self._releaser.close(timeout)
        with self._ledger.lock:
            peers = list(self._peers.values())
        return problems + close_links(peers)
