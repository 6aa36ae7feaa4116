"""The producer's sender thread: it takes each step from the engine thread's queue
and hands every layer to the step's peer lanes as the layer's KV write completes;
each lane writes to its own peer and sends the notices that follow (peer_step.py).

    sender thread: LayerEvents.next_ready() -> wait(i) on the layer's own event
      -> PeerStep.push(i), one lane per peer:
         PeerLink.write_layer (merged descriptors or staging, bounded retries)
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
from ..plan import KVLayout, StepPlan
from .config import ConnectorConfig
from .digest_pipeline import DigestPipeline
from .ledger import ConnectorStats, RequestLedger
from .peer import PeerFailed, PeerLink
from .peer_step import InlinePeerStep, PeerStep, lanes_landed, stop_revoked

log = logging.getLogger(__name__)


@dataclass
class _Step:
    plan: StepPlan
    done: threading.Event = field(default_factory=threading.Event)
    failed_peers: Dict[str, Optional[str]] = field(default_factory=dict)
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
    _tails: Dict[str, PeerStep]  # per peer: its last lane, until seen ended
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
                    self._handle_revokes()
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
        """Hand each layer to every peer's lane as its KV write completes (peer_step.py),
        then wait for the lanes: each writes, and concludes, its own peer's requests.
        With ``detach_slow_lanes_after_s``, a lane still writing that long after the
        last hand-off goes on alone. A step with one peer, when no lane is left to
        finish alone, runs its work on this thread."""
        self._stats.add(steps=1)
        self._reap_lanes()
        self._fail_refused(step)
        peer_ids = [peer_id for peer_id, entries in step.plan.by_peer.items() if entries]
        after = {pid: lane for pid, lane in self._tails.items() if pid in peer_ids and lane.running}
        detach = self._config.detach_slow_lanes_after_s
        lane = PeerStep if len(peer_ids) > 1 or detach is not None or after else InlinePeerStep
        lanes = [lane(step, self._peers[peer_id], self._layout, self._config, self._ledger,
                      self._stats, self._digests, self._stop, after=after.get(peer_id)).start()
                 for peer_id in peer_ids]
        handed: List[Tuple[int, float, float]] = []  # (layer, taken, event ready)
        all_handed = False
        try:
            self._hand_layers(step, lanes, handed)
            all_handed = not self._stop.is_set()
        finally:
            for lane in lanes:
                lane.finish()
            self._join_lanes(lanes, detach if all_handed else None)
        trace: List[dict] = []
        for layer, t0, t1 in handed:
            staged, landed = lanes_landed(lanes, layer, default=t1)
            self._stats.layer(layer, t1 - t0, landed - t1)
            trace.append({"layer": layer, "pushed": self._events.pushed_at(layer), "taken": t0,
                          "event_ready": t1, "staged": staged, "landed": landed})
        self._last_trace = trace
        for lane in lanes:
            if lane.error is not None:
                raise lane.error

    def _join_lanes(self, lanes: List[PeerStep], detach_after_s: Optional[float]) -> None:
        """Wait for the step's lanes; with ``detach_after_s``, at most that long: a lane
        still running then is its peer's tail, which the peer's next lane waits for."""
        deadline = None if detach_after_s is None else time.monotonic() + detach_after_s
        for lane in lanes:
            bounded = deadline is not None and lane.may_detach
            lane.join(max(0.0, deadline - time.monotonic()) if bounded else None)
            if lane.running:
                self._stats.add(lanes_detached=1)
                log.info("peer %s still writing after the step: its lane goes on alone",
                         lane.peer.peer_id)
                self._tails[lane.peer.peer_id] = lane
            else:
                self._tails.pop(lane.peer.peer_id, None)

    def _reap_lanes(self) -> None:
        """Forget the tails that ended; one that ended in an exception (a bug) ends the
        sender thread, as a lane of the running step does."""
        for peer_id, lane in list(self._tails.items()):
            if not lane.running:
                del self._tails[peer_id]
                if lane.error is not None:
                    raise lane.error

    def _hand_layers(self, step: _Step, lanes: List[PeerStep],
                     handed: List[Tuple[int, float, float]]) -> None:
        """Wait for each layer's event, in the order the forward pushes them, and hand
        the layer to the lanes. A step whose layers do not come fails for every peer."""
        remaining = set(range(len(self._caches)))
        deadline = step.started + self._config.step_timeout_s
        lookahead: Optional[Tuple[int, float]] = None  # (layer, taken) popped one layer early
        while remaining:
            if self._stop.is_set():
                return self._fail_step(step, "connector closed during the step")
            if lookahead is not None:
                (layer, t0), lookahead = lookahead, None
            else:
                layer = self._events.next_ready(timeout=0.05)
                t0 = time.perf_counter()
                if layer is None:
                    for lane in lanes:
                        lane.idle()
                    if time.monotonic() > deadline:
                        return self._fail_step(step, f"layers {sorted(remaining)} not pushed within "
                                                     f"{self._config.step_timeout_s} s")
                    continue
                if layer not in remaining:
                    self._stats.add(orphan_pushes=1)
                    continue
            if not self._events.wait(layer, timeout=self._config.event_timeout_s):
                return self._fail_step(step, f"layer {layer}'s event did not complete")
            t1 = time.perf_counter()
            lookahead, prefetch = self._peek_next(remaining - {layer})
            for lane in lanes:
                lane.push(layer, prefetch)
            handed.append((layer, t0, t1))
            self._stats.add(layers_sent=1)
            remaining.discard(layer)

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
            log.warning("request %s refused: %s", req_id, reason)
            tail = self._tails.get(req.peer)
            if tail is not None:  # it owns the link until it ends (rare: refusals are)
                tail.join()
            peer = self._peers.get(req.peer)
            if peer is not None and not peer.dead:
                try:
                    if req_id not in peer.begin({req_id: np.zeros(0, dtype=np.int64)}):
                        peer.notify_failed(req_id, f"refused by the producer: {reason}")
                except PeerFailed as exc:
                    log.warning("peer %s: failure of refused request %s not delivered: %s",
                                req.peer, req_id, exc)
            self._stats.add(failed_refused=1)
            self._ledger.report(req_id, ok=False, hold=peer.quarantine() if peer is not None else None)

    def _handle_revokes(self) -> None:
        """Between steps: read what consumers sent meanwhile and stop the requests they
        revoked (in a step, each peer's lane does this for its own peer)."""
        self._reap_lanes()
        with self._ledger.lock:
            peers = [peer for pid, peer in self._peers.items() if pid not in self._tails]
        for peer in peers:
            if not peer.dead:
                peer.poll()
                if peer.revoked:
                    stop_revoked(peer, self._ledger, self._stats)

    def _fail_step(self, step: _Step, reason: str) -> None:
        """Every peer of the step fails; their lanes write nothing more and send the
        failure notices."""
        log.error("step failed: %s", reason)
        for peer_id in step.plan.by_peer:
            step.failed_peers.setdefault(peer_id, reason)
