"""LayerwiseConnector: push each layer's KV blocks to decode while later layers compute.

Producer (prefill) data flow, one way:

    model writes layer i's KV -> save_kv_layer(i): record_layer_event + push_layer
      -> sender thread: LayerEvents.next_ready() -> wait(i) on the layer's own event
      -> transport.write(layer i's merged descriptors, per peer, bounded retries)
      -> after the step's last layer: control notice "chunk landed" per request

Consumer (decode): registers its caches, serves a control channel, and reports a
request finished once the notice for its last chunk arrives (notices are sent only
after the bytes landed), or failed on a failure notice or when its lease expires.
See docs/connector.md for threads and failure semantics.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from . import ops
from .control import ControlClient, ControlServer, Session
from .events import LayerEvents
from .plan import KVLayout, StepPlan, TransferRequest, layer_descriptors, validate_step
from .staging import ConsumerStaging, ProducerStaging, StagingGrant, uniform_block
from .transports.base import Transport, TransportError

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


@dataclass
class ConnectorConfig:
    """Timeouts and retry policy. Every wait is bounded by one of these."""

    transfer_timeout_s: float = 5.0  # one write of one layer to one peer
    max_retries: int = 2  # extra attempts after a transient transport error
    retry_backoff_s: float = 0.05  # doubled after each retry
    event_timeout_s: float = 60.0  # a pushed layer's device event must complete by then
    step_timeout_s: float = 600.0  # all layers of a step must be pushed by then
    lease_s: float = 30.0  # consumer: a started request must progress within this
    control_timeout_s: float = 5.0  # connect/send on the control channel
    quarantine_s: float = 1.0  # a write that failed may still land late (Mooncake#4247)
    # Staging of fragmented layers (docs/connector.md). A layer whose merged
    # descriptors average fewer bytes than the threshold goes through staging slots.
    staging_threshold_bytes: int = 256 << 10  # 0 disables staging
    staging_slot_bytes: int = 8 << 20
    staging_slots: int = 4  # per producer on the consumer; in flight before an ack


@dataclass
class _Peer:
    peer_id: str
    layout: KVLayout
    data_address: str
    control: ControlClient
    staging: Optional[ProducerStaging] = None
    dead: Optional[str] = None  # reason, once the peer is given up on


@dataclass
class _Step:
    plan: StepPlan
    done: threading.Event = field(default_factory=threading.Event)
    failed_peers: Dict[str, str] = field(default_factory=dict)
    retried_peers: Set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic)


@dataclass
class _Incoming:
    deadline: float
    chunks: int = 0
    bytes: int = 0


class _Stats:
    def __init__(self, num_layers: int) -> None:
        self.lock = threading.Lock()
        self.counters = dict(bytes_sent=0, layers_sent=0, steps=0, requests_finished=0,
                             requests_failed=0, retries=0, transport_errors=0, orphan_pushes=0,
                             staged_writes=0)
        self.wait_s = np.zeros(num_layers)
        self.transfer_s = np.zeros(num_layers)
        self.samples = np.zeros(num_layers, dtype=np.int64)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for key, value in deltas.items():
                self.counters[key] += value

    def layer(self, layer: int, wait_s: float, transfer_s: float) -> None:
        with self.lock:
            self.wait_s[layer] += wait_s
            self.transfer_s[layer] += transfer_s
            self.samples[layer] += 1

    def snapshot(self) -> dict:
        with self.lock:
            n = np.maximum(self.samples, 1)
            out = dict(self.counters)
            out["layer_wait_s_mean"] = (self.wait_s / n).tolist()
            out["layer_transfer_s_mean"] = (self.transfer_s / n).tolist()
            out["layer_samples"] = self.samples.tolist()
            return out


class LayerwiseConnector:
    """Layer-wise KV transfer between a producer (prefill) and consumers (decode).

    Producer: ``register_kv_caches`` -> ``add_peer(consumer.peer_info())`` -> per step
    ``start_step(requests)``, model forward calling ``save_kv_layer(i, cache_i)`` after
    each layer's KV write (or ``attach``), ``wait_for_save()``, ``get_finished()``.
    A request's source blocks must stay allocated until it is reported finished or
    failed. Consumer: ``register_kv_caches`` -> share ``peer_info()`` -> optionally
    ``expect(req_id)`` -> poll ``get_finished()``.
    """

    def __init__(self, role: str, transport: Transport, config: Optional[ConnectorConfig] = None,
                 *, control_host: Optional[str] = None) -> None:
        if role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}")
        self.role = role
        self.transport = transport
        self.config = config or ConnectorConfig()
        self.engine_id = uuid.uuid4().hex[:12]
        self._control_host = control_host or transport.address().rsplit(":", 1)[0]
        self._lock = threading.Lock()
        self._caches: List[torch.Tensor] = []
        self._layout: Optional[KVLayout] = None
        self._registered: List[int] = []
        self._finished: Set[str] = set()
        self._failed: Set[str] = set()
        self._delayed: List[Tuple[float, str, bool]] = []  # (due, req_id, ok): quarantined
        self._reported: "OrderedDict[str, None]" = OrderedDict()  # ids already reported
        self._closed = False
        self._hooks: list = []
        # producer
        self._peers: Dict[str, _Peer] = {}
        self._in_flight: Dict[str, str] = {}
        self._events: Optional[LayerEvents] = None
        self._steps: "queue.Queue[Optional[_Step]]" = queue.Queue()
        self._current: Optional[_Step] = None
        self._sender: Optional[threading.Thread] = None
        self._sender_error: Optional[BaseException] = None
        self._last_trace: List[dict] = []
        self._stop = threading.Event()
        # consumer
        self._incoming: Dict[str, _Incoming] = {}
        self._server: Optional[ControlServer] = None
        self._consumer_staging: Optional[ConsumerStaging] = None
        self._stats: Optional[_Stats] = None

    # ------------------------------------------------------------------ set-up

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """Register one cache tensor per layer (dim 0 = block) with the transport."""
        if self._layout is not None:
            raise RuntimeError("register_kv_caches was already called")
        devices = {c.device for c in kv_caches}
        if len(devices) != 1:
            raise ValueError(f"all KV caches must be on one device, got {sorted(map(str, devices))}")
        device = next(iter(devices))
        if not self.transport.supports_device(device.type):
            raise ValueError(f"transport {self.transport.name!r} cannot move {device.type} memory "
                             "(for CUDA caches install the CUDA build of Mooncake, "
                             "mooncake-transfer-engine)")
        self._layout = KVLayout.of(kv_caches)
        self._caches = list(kv_caches)
        self._stats = _Stats(len(self._caches))
        for layer in self._layout.layers:
            base, length = layer.span()
            self.transport.register(base, length)
            self._registered.append(base)
        if self.role == "producer":
            self._events = LayerEvents(len(self._caches), device)
            for i, cache in enumerate(self._caches):
                self._events.bind(i, cache)
            self._sender = threading.Thread(target=self._sender_main, name="kvops-sender", daemon=True)
            self._sender.start()
        else:
            if self._can_stage():
                self._consumer_staging = ConsumerStaging(self._caches, self.transport,
                                                         self.config.staging_slot_bytes,
                                                         self.config.staging_slots)
            self._server = ControlServer(self._control_host, self._on_control, self._on_producer_gone,
                                         self._expire_leases,
                                         send_timeout_s=self.config.control_timeout_s)
        log.info("%s %s registered %d KV layers", self.role, self.engine_id, len(self._caches))

    def peer_info(self) -> dict:
        """Consumer: JSON-serializable description (addresses and cache layout)."""
        self._require("consumer", registered=True)
        return {"version": PROTOCOL_VERSION, "engine_id": self.engine_id,
                "transport": self.transport.name, "data_address": self.transport.address(),
                "control_address": self._server.address, "layout": self._layout.to_json()}

    def add_peer(self, info: dict) -> str:
        """Producer: validate a consumer's layout against ours, connect its control
        channel, and return its peer id."""
        self._require("producer", registered=True)
        if info.get("version") != PROTOCOL_VERSION:
            raise ValueError(f"peer speaks protocol {info.get('version')}, this side {PROTOCOL_VERSION}")
        if info.get("transport") != self.transport.name:
            raise ValueError(f"peer uses transport {info.get('transport')!r}, this side "
                             f"{self.transport.name!r}")
        layout = KVLayout.from_json(info["layout"])
        self._layout.check_compatible(layout)
        with self._lock:
            known = self._peers.get(info["engine_id"])
        if known is not None and not known.dead:
            if known.data_address != info["data_address"] or known.layout != layout:
                raise ValueError(f"peer {known.peer_id!r} is already known with another address "
                                 "or layout")
            return known.peer_id  # the same peer again (e.g. per-request peer_info)
        if known is not None:
            if any(p == known.peer_id for p in self._in_flight.values()):
                raise RuntimeError(f"peer {known.peer_id!r} still has requests in flight")
            self._release_peer(known)
        control = ControlClient(info["control_address"], timeout_s=self.config.control_timeout_s,
                                retries=self.config.max_retries,
                                backoff_s=self.config.retry_backoff_s)
        control.connect()
        control.send({"op": "hello", "producer": self.engine_id, "staging": self._can_stage()})
        welcome = control.receive(self.config.control_timeout_s)
        if welcome is None or welcome.get("op") != "welcome":
            control.close()
            raise ConnectionError(f"peer at {info['control_address']} did not answer hello")
        peer = _Peer(info["engine_id"], layout, info["data_address"], control)
        grant = welcome.get("staging")
        if grant and self._can_stage():
            peer.staging = ProducerStaging(self._caches, self.transport, StagingGrant(**grant))
        with self._lock:
            self._peers[peer.peer_id] = peer
        return peer.peer_id

    def _can_stage(self) -> bool:
        """Staging gathers on the host: CPU caches with one block shape and dtype.
        (A device-side gather would need its own stream and event.)"""
        return (self.config.staging_threshold_bytes > 0 and self._caches[0].device.type == "cpu"
                and uniform_block(self._caches) is not None)

    def attach(self, model: torch.nn.Module, layers: Sequence[torch.nn.Module]) -> list:
        """Call ``save_kv_layer(i, cache_i)`` after ``layers[i]``'s forward (forward
        hooks), for model code that should not be edited. Returns the hook handles."""
        self._require("producer", registered=True)
        if len(layers) != len(self._caches):
            raise ValueError(f"{len(layers)} layers given for {len(self._caches)} KV caches")
        for i, module in enumerate(layers):
            self._hooks.append(module.register_forward_hook(self._make_hook(i)))
        return list(self._hooks)

    def _make_hook(self, layer: int):
        def hook(module, args, output):
            self.save_kv_layer(layer, self._caches[layer])
        return hook

    # ------------------------------------------------------------------ producer step

    def start_step(self, requests: Iterable[TransferRequest]) -> None:
        """Validate this step's requests (``ValueError``, nothing sent) and hand the
        plan to the sender. Requests to a peer already given up on fail at once."""
        self._require("producer", registered=True)
        self._raise_sender_error()
        if self._current is not None and not self._current.done.is_set():
            raise RuntimeError("the previous step is still sending: call wait_for_save() first")
        requests = list(requests)
        with self._lock:
            peers = {pid: p.layout for pid, p in self._peers.items()}
            plan = validate_step(requests, self._layout, peers, self._in_flight)
            for req in requests:
                self._in_flight[req.req_id] = req.peer
        # Pushes of a forward that ran without a step would be taken for this step's.
        while self._events.next_ready(timeout=0) is not None:
            self._stats.add(orphan_pushes=1)
        step = _Step(plan)
        self._current = step
        self._steps.put(step)

    def save_kv_layer(self, layer: int, kv_cache: torch.Tensor) -> None:
        """Model hook: call right after layer ``layer``'s KV write. Only issues two ops
        with constant arguments, so it traces into torch.compile(fullgraph=True) and is
        captured with the model in a CUDA graph."""
        ops.record_layer_event(kv_cache, self._events.handle, layer)
        ops.push_layer(kv_cache, self._events.handle, layer)

    def wait_for_save(self, timeout: Optional[float] = None) -> None:
        """Block until every layer of the current step was sent or failed."""
        self._require("producer", registered=True)
        step = self._current
        if step is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not step.done.wait(0.1):
            self._raise_sender_error()
            if not self._sender.is_alive():
                raise RuntimeError("the sender thread is not running (connector closed?)")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"step not finished sending after {timeout} s")
        self._raise_sender_error()

    # ------------------------------------------------------------------ sender thread

    def _sender_main(self) -> None:
        try:
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
        trace: List[dict] = []
        for peer_id, entries in list(step.plan.by_peer.items()):
            peer = self._peers[peer_id]
            if peer.dead:
                step.failed_peers[peer_id] = peer.dead
                continue
            rejected = self._begin(peer, [req.req_id for req, _, _ in entries])
            if rejected is None:
                step.failed_peers[peer_id] = peer.dead
                continue
            if rejected:  # the consumer gave up on them already: write nothing
                log.warning("peer %s no longer accepts %s", peer_id, sorted(rejected))
                for req_id in rejected:
                    self._report(req_id, ok=False)
                step.plan.by_peer[peer_id] = [e for e in entries if e[0].req_id not in rejected]
        by_layer = self._step_descriptors(step)
        remaining = set(range(len(self._caches)))
        deadline = step.started + self.config.step_timeout_s
        while remaining:
            if self._stop.is_set():
                self._fail_step(step, "connector closed during the step")
                return
            layer = self._events.next_ready(timeout=0.05)
            if layer is None:
                if time.monotonic() > deadline:
                    self._fail_step(step, f"layers {sorted(remaining)} not pushed within "
                                          f"{self.config.step_timeout_s} s")
                    return
                continue
            if layer not in remaining:
                self._stats.add(orphan_pushes=1)
                continue
            t0 = time.perf_counter()
            if not self._events.wait(layer, timeout=self.config.event_timeout_s):
                self._fail_step(step, f"layer {layer}'s event did not complete")
                return
            t1 = time.perf_counter()
            for peer_id, blocks, (src, dst, lengths) in by_layer(layer):
                if peer_id not in step.failed_peers:
                    self._write_layer(step, peer_id, layer, blocks, src, dst, lengths)
            t2 = time.perf_counter()
            self._stats.layer(layer, t1 - t0, t2 - t1)
            trace.append({"layer": layer, "pushed": t0, "event_ready": t1, "landed": t2})
            self._last_trace = trace
            self._stats.add(layers_sent=1)
            remaining.discard(layer)
        self._finish_step(step)

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

    def _write_layer(self, step: _Step, peer_id: str, layer: int, blocks, src, dst, lengths) -> None:
        peer = self._peers[peer_id]
        if self._stop.is_set():
            return
        if peer.control.peer_closed():
            self._give_up_peer(step, peer, "peer closed its control channel (process gone?)")
            return
        fragmented = lengths.size > 1 and lengths.mean() < self.config.staging_threshold_bytes
        if peer.staging is not None and fragmented:
            self._write_staged(step, peer, layer, *blocks)
        elif self._write_with_retries(step, peer, layer, src, dst, lengths):  # numpy: no list round trip
            self._stats.add(bytes_sent=int(lengths.sum()))

    def _write_staged(self, step: _Step, peer: _Peer, layer: int, src_blocks, dst_blocks) -> None:
        """Slot by slot: gather, write, scatter notice. The gather of the next slot runs
        while the current one is on the wire (both release the GIL)."""
        staging = peer.staging
        per_slot = staging.grant.slot_blocks
        starts = list(range(0, src_blocks.size, per_slot))
        slot = self._claim_slot(step, peer)
        if slot is None:
            return
        pending = staging.gather_async(layer, slot, src_blocks[:per_slot])
        try:
            for i, start in enumerate(starts):
                desc, pending = pending.result(), None
                following = None
                if i + 1 < len(starts):
                    following = self._claim_slot(step, peer)
                    if following is None:
                        return
                    nxt = starts[i + 1]
                    pending = staging.gather_async(layer, following, src_blocks[nxt:nxt + per_slot])
                if not self._write_with_retries(step, peer, layer, [desc[0]], [desc[1]], [desc[2]]):
                    return
                self._stats.add(bytes_sent=desc[2], staged_writes=1)
                staging.busy[slot] = True
                if not self._control_send(peer, {"op": "scatter", "producer": self.engine_id,
                                                 "layer": layer, "slot": slot,
                                                 "dst": dst_blocks[start:start + per_slot].tolist()}):
                    step.failed_peers[peer.peer_id] = peer.dead
                    return
                slot = following
        finally:
            if pending is not None:
                pending.result()  # never leave a copy running into a buffer about to be released

    def _claim_slot(self, step: _Step, peer: _Peer) -> Optional[int]:
        """The next staging slot, once the peer has released it (ack)."""
        slot = peer.staging.next_slot()
        if peer.staging.busy[slot] and not self._await_ack(peer, slot):
            self._give_up_peer(step, peer, f"staging slot {slot} was not released in time")
            return None
        return slot

    def _begin(self, peer: _Peer, req_ids: List[str]) -> Optional[set]:
        """Announce the step's requests; the consumer answers with those it no longer
        accepts (already reported failed, e.g. its lease expired). None: peer failed."""
        if not self._control_send(peer, {"op": "begin", "reqs": req_ids}):
            return None
        answer = self._receive_until(peer, lambda m: m.get("op") == "begun")
        return None if answer is None else set(answer.get("rejected", []))

    def _await_ack(self, peer: _Peer, slot: int) -> bool:
        return self._receive_until(peer, lambda m: not peer.staging.busy[slot]) is not None

    def _receive_until(self, peer: _Peer, done) -> Optional[dict]:
        """Read the peer's messages (staging acks are handled on the way) until
        ``done(message)``; None on timeout, close, or a broken channel."""
        deadline = time.monotonic() + self.config.transfer_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.is_set():
                return None
            try:
                message = peer.control.receive(min(remaining, 0.1))
            except ConnectionError as exc:
                peer.dead = peer.dead or f"control channel failed: {exc}"
                return None
            if message is None:
                continue
            if message.get("op") == "ack" and peer.staging is not None:
                peer.staging.busy[int(message["slot"])] = False
            if done(message):
                return message

    def _write_with_retries(self, step: _Step, peer: _Peer, layer: int, src, dst, lengths) -> bool:
        attempt = 0
        while True:
            try:
                self.transport.write(peer.data_address, src, dst, lengths,
                                     timeout_s=self.config.transfer_timeout_s)
                return True
            except TransportError as exc:
                self._stats.add(transport_errors=1)
                if not exc.transient or attempt >= self.config.max_retries or self._stop.is_set():
                    self._give_up_peer(step, peer, f"layer {layer} write failed: {exc}")
                    return False
                attempt += 1
                step.retried_peers.add(peer.peer_id)
                self._stats.add(retries=1)
                log.warning("retrying layer %d to %s (attempt %d): %s", layer, peer.peer_id, attempt, exc)
                time.sleep(self.config.retry_backoff_s * (2 ** (attempt - 1)))

    def _give_up_peer(self, step: _Step, peer: _Peer, reason: str) -> None:
        log.error("giving up on peer %s: %s", peer.peer_id, reason)
        peer.dead = reason
        step.failed_peers[peer.peer_id] = reason

    def _control_send(self, peer: _Peer, message: dict) -> bool:
        try:
            peer.control.send(message)
            return True
        except ConnectionError as exc:
            peer.dead = peer.dead or f"control channel failed: {exc}"
            return False

    def _finish_step(self, step: _Step) -> None:
        bytes_per_block = sum(layer.block_bytes for layer in self._layout.layers)
        for peer_id, entries in step.plan.by_peer.items():
            peer = self._peers[peer_id]
            for req, src, _ in entries:
                if peer_id not in step.failed_peers:
                    nbytes = int(src.size) * bytes_per_block
                    if self._control_send(peer, {"op": "chunk", "req": req.req_id,
                                                 "last": req.last_chunk, "bytes": nbytes}):
                        if req.last_chunk:
                            # a retried write's first attempt may still land late
                            delay = self.config.quarantine_s if peer_id in step.retried_peers else 0.0
                            self._report(req.req_id, ok=True, delay=delay)
                        continue
                    step.failed_peers[peer_id] = peer.dead
                # best effort: a broken channel fails at once (its socket is closed)
                self._control_send(peer, {"op": "failed", "req": req.req_id,
                                          "reason": step.failed_peers[peer_id]})
                self._report(req.req_id, ok=False, delay=self.config.quarantine_s)

    def _fail_step(self, step: _Step, reason: str) -> None:
        log.error("step failed: %s", reason)
        for peer_id in step.plan.by_peer:
            step.failed_peers.setdefault(peer_id, reason)
        self._finish_step(step)

    def _fail_all_in_flight(self, reason: str) -> None:
        with self._lock:
            pending = list(self._in_flight.items())
        for req_id, peer_id in pending:
            peer = self._peers.get(peer_id)
            if peer is not None and not peer.dead:
                self._control_send(peer, {"op": "failed", "req": req_id, "reason": reason})
            self._report(req_id, ok=False)

    # ------------------------------------------------------------------ consumer

    def expect(self, req_id: str, lease_s: Optional[float] = None) -> None:
        """Consumer: start the lease of a request the engine waits for, so it is
        reported failed if its producer never delivers (even if it never started)."""
        self._require("consumer", registered=True)
        with self._lock:
            if req_id not in self._incoming and req_id not in self._reported:
                self._incoming[req_id] = _Incoming(time.monotonic() + (lease_s or self.config.lease_s))

    def _on_control(self, message: dict, session: Session) -> None:
        """Control-server thread. A handler that raises drops only this producer's
        connection (ControlServer), after which the producer fails its requests."""
        op = message.get("op")
        if op == "hello":
            session.producer = str(message["producer"])
            log.info("producer %s connected", session.producer)
            staging = self._consumer_staging if message.get("staging") else None
            grant = staging.grant(session.producer) if staging else None
            session.reply({"op": "welcome", "staging": grant.to_json() if grant else None})
        elif op == "begin":
            session.reply({"op": "begun", "rejected": self._begin_requests(message["reqs"])})
        elif op == "scatter":
            if self._consumer_staging is None or session.producer is None:
                raise ValueError("scatter without a staging grant")
            self._consumer_staging.scatter(session.producer, int(message["layer"]),
                                           int(message["slot"]), message["dst"])
            session.reply({"op": "ack", "slot": int(message["slot"])})
        elif op in ("chunk", "failed"):
            self._request_notice(op, str(message["req"]), message)
        else:
            raise ValueError(f"unknown control message {op!r}")

    def _begin_requests(self, req_ids: List[str]) -> List[str]:
        """Start or renew the leases of a step's requests; return those already
        reported (their blocks may be reused: the producer must not write them)."""
        deadline = time.monotonic() + self.config.lease_s
        rejected = []
        with self._lock:
            for req_id in map(str, req_ids):
                if req_id in self._reported:
                    rejected.append(req_id)
                elif req_id in self._incoming:
                    self._incoming[req_id].deadline = deadline
                else:
                    self._incoming[req_id] = _Incoming(deadline)
        return rejected

    def _request_notice(self, op: str, req_id: str, message: dict) -> None:
        with self._lock:
            entry = self._incoming.get(req_id)
            if entry is None:  # reported already (lease expired) or never begun
                log.warning("ignoring %r for request %s: not in flight here", op, req_id)
                return
            entry.deadline = time.monotonic() + self.config.lease_s
            if op == "chunk":
                entry.chunks += 1
                entry.bytes += int(message.get("bytes", 0))
                if not message.get("last"):
                    return
                self._stats.add(bytes_sent=entry.bytes)
            else:
                log.warning("request %s failed on the producer: %s", req_id, message.get("reason"))
            del self._incoming[req_id]
            self._record_outcome(req_id, ok=op == "chunk")

    def _on_producer_gone(self, session: Session) -> None:
        if self._consumer_staging is not None and session.producer is not None:
            self._consumer_staging.release(session.producer)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [r for r, entry in self._incoming.items() if entry.deadline < now]
            for req_id in expired:
                log.warning("request %s: lease expired before it finished", req_id)
                del self._incoming[req_id]
                self._record_outcome(req_id, ok=False)

    # ------------------------------------------------------------------ both roles

    def _report(self, req_id: str, ok: bool, delay: float = 0.0) -> None:
        with self._lock:
            if self._in_flight.pop(req_id, None) is None:
                return  # already reported
            if delay > 0:
                self._delayed.append((time.monotonic() + delay, req_id, ok))
            else:
                self._record_outcome(req_id, ok)

    def _record_outcome(self, req_id: str, ok: bool) -> None:
        """Under ``self._lock``: queue the id for get_finished, remember it was reported."""
        (self._finished if ok else self._failed).add(req_id)
        self._reported[req_id] = None
        if len(self._reported) > 100_000:
            self._reported.popitem(last=False)
        self._stats.add(**{"requests_finished" if ok else "requests_failed": 1})

    def get_finished(self) -> Tuple[Set[str], Set[str]]:
        """(finished, failed) request ids since the last call; each id is reported once.
        Producer: finished means every byte was sent and acknowledged as landed, so the
        source blocks may be freed. Consumer: every layer of every chunk has landed."""
        if self._server is not None:
            self._server.check()
        now = time.monotonic()
        with self._lock:
            for _, req_id, ok in [d for d in self._delayed if d[0] <= now]:
                self._record_outcome(req_id, ok)
            self._delayed = [d for d in self._delayed if d[0] > now]
            finished, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
        return finished, failed

    def last_step_trace(self) -> List[dict]:
        """Per layer of the last step: when the sender took the push (``pushed``), when
        the layer's event was complete (``event_ready``) and when its writes returned,
        i.e. its bytes landed (``landed``); ``time.perf_counter()`` seconds."""
        return list(self._last_trace)

    def stats(self) -> dict:
        """Counters (bytes, layers, requests finished/failed, retries, errors) and
        per-layer mean wait-for-event and transfer times (producer)."""
        if self._stats is None:
            return {}
        out = self._stats.snapshot()
        out["role"] = self.role
        with self._lock:
            out["in_flight"] = len(self._in_flight) + len(self._incoming)
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Stop threads, report unfinished requests failed, unregister memory. Raises
        if a thread did not stop within ``timeout`` (after releasing everything else)."""
        if self._closed:
            return
        self._closed = True
        problems = []
        try:
            for handle in self._hooks:
                handle.remove()
            self._stop.set()
            if self._events is not None:
                self._events.close()  # wakes a sender blocked in next_ready
            if self._sender is not None:
                self._steps.put(None)
                self._sender.join(timeout)
                if self._sender.is_alive():
                    problems.append("the sender thread did not stop within the close timeout")
                self._fail_all_in_flight("connector closed")
            if self._server is not None:
                try:
                    self._server.close(timeout)
                except RuntimeError as exc:
                    problems.append(str(exc))
                with self._lock:
                    for req_id in list(self._incoming):
                        self._record_outcome(req_id, ok=False)
                    self._incoming.clear()
        finally:
            with self._lock:
                peers = list(self._peers.values())
                for _, req_id, ok in self._delayed:
                    self._record_outcome(req_id, ok)
                self._delayed.clear()
            # Every release is attempted even if one fails (e.g. a region still read by
            # a timed-out write); the failures are raised together below.
            releases = [lambda p=p: self._release_peer(p) for p in peers]
            if self._consumer_staging is not None:
                releases.append(self._consumer_staging.close)
            releases += [lambda b=b: self.transport.unregister(b) for b in self._registered]
            for release in releases:
                try:
                    release()
                except (TransportError, OSError) as exc:
                    problems.append(f"release failed: {exc}")
            self._registered.clear()
        if problems:
            raise RuntimeError("; ".join(problems))

    def _release_peer(self, peer: _Peer) -> None:
        peer.control.close()
        if peer.staging is not None:
            peer.staging.close()
            peer.staging = None

    def __enter__(self) -> "LayerwiseConnector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _require(self, role: str, registered: bool = False) -> None:
        if self.role != role:
            raise RuntimeError(f"this call is for the {role} role; this connector is a {self.role}")
        if registered and self._layout is None:
            raise RuntimeError("call register_kv_caches first")
        if self._closed:
            raise RuntimeError("the connector is closed")

    def _raise_sender_error(self) -> None:
        if self._sender_error is not None:
            raise RuntimeError("the sender thread failed") from self._sender_error
