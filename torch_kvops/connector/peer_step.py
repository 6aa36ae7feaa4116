"""One consumer's part of a producer step, on its own lane thread.

    sender thread:  layer i's event complete -> lane.push(i) for every peer of the step
    lane (one per peer): begin -> write layer i -> digests -> ... -> chunk notices

Each peer's writes, staging acks, revokes and notices run in order on that peer's
lane, so a slow consumer (writes that take just under the transfer timeout, a ``begin``
answered late, staging slots released late) delays only its own requests: the other
peers' layers land as their KV is written, and their chunk notices go out as soon as
their own writes are over. A peer still writing when the step's budget
(``step_timeout_s``) ends is failed alone; the others' outcomes stand. A lane whose
step outlasts half its write lease, while it runs, announces its requests again before
its next write (a new grant), so a slow forward is not taken for a stopped producer.

With ``detach_slow_lanes_after_s``, a lane still writing once the step's layers are
handed over is left to finish alone (the engine's next step goes on): the peer's lane
of a later step starts after it ends (``after``), and an abort of one of its requests
(:meth:`PeerStep.abort`) stops that request's writes before the lane's next write.

A lane owns its :class:`~torch_kvops.connector.peer.PeerLink` while it runs: nothing
else reads its control channel until the lane ended.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import numpy as np

from ..plan import KVLayout, layer_descriptors
from .config import ConnectorConfig
from .digest_pipeline import DigestPipeline
from .ledger import HOLD_POLL_S, ConnectorStats, RequestLedger
from .peer import PeerFailed, PeerLink

if TYPE_CHECKING:
    from .sender import _Step

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.05  # how soon a revoke is acknowledged while the forward runs


def stop_revoked(peer: PeerLink, ledger: RequestLedger, stats: ConnectorStats) -> Set[str]:
    """Acknowledge what the consumer revoked (no write of those requests starts after
    this) and report the revoked requests still in flight with this peer failed.
    Returns the revoked request ids."""
    revoked = peer.acknowledge_revokes()
    for req_id in sorted(revoked):
        with ledger.lock:
            ours = ledger.in_flight.get(req_id) == peer.peer_id
        if ours:
            log.warning("peer %s revoked request %s: stopped", peer.peer_id, req_id)
            stats.add(failed_revoked=1)
            ledger.report(req_id, ok=False, hold=peer.quarantine())
    return revoked


def fail_aborted(peer: Optional[PeerLink], req_id: str, reason: str, ledger: RequestLedger,
                 stats: ConnectorStats) -> None:
    """A request the engine dropped, no write of which starts any more: its consumer is
    told (best effort) and its failure reported, held while a failed write may still
    read its source."""
    if peer is not None and not peer.dead:
        peer.notify_failed(req_id, reason)
    stats.add(failed_aborted=1)
    ledger.report(req_id, ok=False, hold=peer.quarantine() if peer is not None else None)


class PeerStep:
    """A peer's requests of one step: announced, written layer by layer as the sender
    hands layers over, and concluded (chunk or failure notices, outcomes reported)."""

    def __init__(self, step: "_Step", peer: PeerLink, layout: KVLayout, config: ConnectorConfig,
                 ledger: RequestLedger, stats: ConnectorStats, digests: DigestPipeline,
                 stop: threading.Event, after: Optional["PeerStep"] = None) -> None:
        self.peer = peer
        self.error: Optional[BaseException] = None  # a bug, re-raised by the sender thread
        self.landed: Dict[int, float] = {}  # layer -> when its write returned (perf_counter)
        self.staged: Dict[int, float] = {}  # layer -> when its last slot was staged
        self._step = step
        self._entries = list(step.plan.by_peer[peer.peer_id])
        self._layout = layout
        self._config = config
        self._ledger = ledger
        self._stats = stats
        self._digests = digests
        self._stop = stop
        self._deadline = step.started + config.step_timeout_s
        self._after = after  # the peer's lane of an earlier step, still running
        self._lock = threading.Lock()  # the engine thread's abort() against this lane
        self._aborted: Dict[str, str] = {}  # request -> reason, not yet dropped
        self._concluding = False
        self._merge()
        self._jobs: "queue.Queue[Optional[Tuple[int, Optional[int]]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="kvops-lane", daemon=True)

    # ------------------------------------------------------------------ sender thread

    def start(self) -> "PeerStep":
        """Start the lane: it announces the peer's requests, then waits for layers."""
        self._thread.start()
        return self

    def push(self, layer: int, prefetch: Optional[int]) -> None:
        """Write ``layer`` (its KV write is complete); ``prefetch``: the next layer, if
        its KV write is complete too (staging gathers its first slots early)."""
        self._jobs.put((layer, prefetch))

    def finish(self) -> None:
        """No more layers: conclude the step once the pushed ones are written."""
        self._jobs.put(None)

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the lane to end (at most ``timeout``). Bounded without one: each
        write is bounded by the transfer timeout and its retries, layers handed over
        after the step's budget ended are not written, and an earlier lane it waits
        for is bounded alike."""
        self._thread.join(timeout)

    def idle(self) -> None:
        """The sender waits for a layer (the lane thread reads its peer meanwhile)."""

    @property
    def running(self) -> bool:
        """The lane's thread has not ended (it owns its peer's link until it does)."""
        return self._thread.is_alive()

    @property
    def may_detach(self) -> bool:
        """Whether the lane may finish alone while the engine's next step runs. Not
        with integrity digests of a chunk that is not a request's last: the next
        forward writes the rest of the chunk's last, partial block, and a digest read
        after that would not match the bytes written before (a false failure)."""
        return self.peer.digester is None or all(req.last_chunk for req, _, _ in self._entries)

    # ------------------------------------------------------------------ engine thread

    def abort(self, req_id: str, reason: str) -> bool:
        """Stop ``req_id``'s writes in this lane and the earlier ones it waits for (a
        detached lane's request the engine dropped): none starts after this returns;
        the lane then tells the consumer and reports the request failed. False if no
        running lane carries it; a lane that concludes already is waited for (its
        notices only), so the request's outcome is decided when this returns."""
        earlier = self._after
        marked = earlier is not None and earlier.running and earlier.abort(req_id, reason)
        with self._lock:
            carried = any(req.req_id == req_id for req, _, _ in self._entries)
            if carried and not self._concluding:
                self._aborted[req_id] = reason
                return True
        if carried:
            self.join()
        return marked

    # ------------------------------------------------------------------ lane thread

    @property
    def _failed(self) -> Optional[str]:
        return self._step.failed_peers.get(self.peer.peer_id)

    def _fail(self, reason: str) -> None:
        self._step.failed_peers.setdefault(self.peer.peer_id, reason)

    def _main(self) -> None:
        try:
            if self._after is not None:  # one lane at a time owns the peer's link
                self._after.join()
                self._after = None
            self._begin()
            while True:
                try:
                    job = self._jobs.get(timeout=_IDLE_POLL_S)
                except queue.Empty:
                    self._handle_revokes()
                    continue
                if job is None:
                    break
                self._write(*job)
            self._conclude()
        except BaseException as exc:  # reported by the sender thread, never swallowed
            log.exception("lane of peer %s failed", self.peer.peer_id)
            self.error = exc
        finally:
            self.peer.drop_prefetch()
            self._digests.discard(self.peer.peer_id)  # left only when the lane raised

    def _begin(self) -> None:
        """Announce the requests; drop (and fail) those the peer no longer accepts.
        Again before a write once half the write lease is spent, while it runs: a begin
        for requests begun already renews their leases on the consumer and grants a new
        write lease, so a step slower than the lease (a slow forward) goes on while its
        layers keep coming; a producer that stopped past its lease renews nothing, and
        the fence stands."""
        peer = self.peer
        self._drop_aborted()
        if peer.dead:
            self._fail(peer.dead)
            return
        try:
            rejected = peer.begin({req.req_id: dst for req, _, dst in self._entries})
        except PeerFailed as exc:
            self._fail(str(exc))
            return
        if rejected:  # the consumer gave up on them already: write nothing
            log.warning("peer %s no longer accepts %s", peer.peer_id, sorted(rejected))
            self._stats.add(failed_rejected_by_decode=len(rejected))
            for req_id in rejected:
                self._ledger.report(req_id, ok=False)
            self._drop(rejected)
            peer.drop_prefetch()  # gathered for the blocks of the old plan (a renewal's)

    def _handle_revokes(self) -> None:
        peer = self.peer
        if peer.dead:
            return
        peer.poll()
        if not peer.revoked:
            return
        revoked = stop_revoked(peer, self._ledger, self._stats)
        in_step = {req.req_id for req, _, _ in self._entries} & revoked
        if in_step:
            self._drop(in_step)
            peer.drop_prefetch()  # gathered for the blocks of the old plan

    def _write(self, layer: int, prefetch: Optional[int]) -> None:
        if self._stop.is_set():
            self._fail("connector closed during the step")
        elif time.monotonic() > self._deadline:
            self._fail(f"layer {layer} not written within step_timeout_s "
                       f"({self._config.step_timeout_s} s)")
        if self._failed is not None:
            return
        self._drop_aborted()
        self._handle_revokes()
        if self._failed is None and self._src.size and self.peer.write_lease_renewable():
            self._stats.add(write_lease_renewals=1)
            self._begin()
        if self._failed is not None or not self._src.size:
            return
        peer = self.peer
        src, dst = self._src, self._dst
        if self._windowed:
            src, dst = self._layer_blocks(layer)
            if prefetch is not None and self._firsts(prefetch) != self._firsts(layer):
                prefetch = None  # the staged prefetch gathers this layer's blocks
        if src.size:
            descriptors = layer_descriptors(self._layout.layers[layer], peer.layout.layers[layer], src, dst)
            try:
                _, staged_at = peer.write_layer(layer, src, dst, *descriptors, prefetch=prefetch)
            except PeerFailed as exc:
                self._fail(str(exc))
                return
            if staged_at is not None:
                self.staged[layer] = staged_at
        self.landed[layer] = time.perf_counter()
        if peer.digester is not None:  # integrity check: digested on the digest worker
            if not self._windowed:  # the usual case: every block of every request
                self._digests.submit(peer, layer, {req.req_id: blocks for req, blocks, _ in self._entries})
            else:
                firsts = dict(zip((req.req_id for req, _, _ in self._entries), self._firsts(layer)))
                moved = {req.req_id: blocks[firsts[req.req_id]:] for req, blocks, _ in self._entries}
                self._digests.submit(peer, layer, moved, {r: f for r, f in firsts.items() if f})
        self._digests.send_ready(peer, self._step.failed_peers)  # earlier layers', if done

    def _conclude(self) -> None:
        """Per request: a "chunk landed" notice (all its bytes of this step returned
        from the transport), or a failure notice; the outcome reported."""
        peer = self.peer
        with self._lock:
            self._concluding = True
        self._drop_aborted()
        layers = self._layout.layers
        self._digests.send_ready(peer, self._step.failed_peers, wait=True)  # before chunk notices
        # A "last" notice lets the consumer hand the request's blocks to its engine, so
        # it goes out only once no transfer a failed or timed-out write to this peer
        # left behind still runs (one may land late, with whatever its source then
        # holds, Mooncake#4247). One still running after quarantine_s fails the request
        # instead: the consumer fences its blocks until no write of it can land.
        settled = (self._failed is not None or not any(req.last_chunk for req, _, _ in self._entries)
                   or self._left_behind_writes_ended(self._config.quarantine_s))
        for req, src, dst in self._entries:
            if self._failed is None and req.last_chunk and not settled:
                log.warning("request %s to %s: transfers of a failed write still run after "
                            "quarantine_s (%.1f s); failed, not finished", req.req_id, peer.peer_id,
                            self._config.quarantine_s)
                peer.notify_failed(req.req_id, "transfers of a failed write still run")
                self._stats.add(failed_push=1)
                self._ledger.report(req.req_id, ok=False, hold=peer.quarantine())
                continue
            if self._failed is None:
                try:
                    moved = sum((src.size - req.first_block(i)) * layer.block_bytes
                                for i, layer in enumerate(layers))
                    # dst: what landed (every layer's blocks from its first), so a
                    # request that fails later can keep it
                    peer.send({"op": "chunk", "req": req.req_id, "last": req.last_chunk,
                               "bytes": int(moved), "dst": dst.tolist()})
                    if req.last_chunk:
                        self._ledger.report(req.req_id, ok=True)
                    continue
                except PeerFailed as exc:
                    self._fail(str(exc))
            peer.notify_failed(req.req_id, self._failed)
            self._stats.add(failed_push=1)
            self._ledger.report(req.req_id, ok=False, hold=peer.quarantine())

    def _left_behind_writes_ended(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no transfer a failed or timed-out write to the
        peer left behind still runs (by the transport's tracking); False if one still
        does, or the connector closes first."""
        deadline = time.monotonic() + timeout_s
        while self.peer.writes_may_be_in_flight():
            if time.monotonic() >= deadline or self._stop.wait(HOLD_POLL_S):
                return False
        return True

    def _drop_aborted(self) -> None:
        """Requests the engine aborted (abort()): no write of theirs starts from now;
        their consumer is told and their failure reported."""
        if not self._aborted:  # read without the lock: before each write, almost always empty
            return
        with self._lock:
            carried = {req.req_id for req, _, _ in self._entries}
            # one revoked or rejected meanwhile is failed already
            aborted = {r: why for r, why in self._aborted.items() if r in carried}
            self._aborted = {}
            if aborted:
                self._drop(set(aborted))
        if not aborted:
            return
        self.peer.drop_prefetch()  # gathered for the blocks of the old plan
        for req_id, reason in sorted(aborted.items()):
            fail_aborted(self.peer, req_id, reason, self._ledger, self._stats)

    def _drop(self, req_ids: Set[str]) -> None:
        self._entries = [e for e in self._entries if e[0].req_id not in req_ids]
        self._merge()

    def _merge(self) -> None:
        """The peer's block ids concatenated over its requests: one merged batch per layer."""
        empty = np.zeros(0, dtype=np.int64)
        self._src = np.concatenate([s for _, s, _ in self._entries]) if self._entries else empty
        self._dst = np.concatenate([d for _, _, d in self._entries]) if self._entries else empty
        self._windowed = any(req.layer_first_block for req, _, _ in self._entries)

    def _firsts(self, layer: int) -> Tuple[int, ...]:
        """Per request, the index of the first of its blocks ``layer`` moves."""
        return tuple(req.first_block(layer) for req, _, _ in self._entries)

    def _layer_blocks(self, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """The blocks ``layer`` moves, merged over the requests (``layer_first_block``)."""
        firsts = self._firsts(layer)
        if not any(firsts):
            return self._src, self._dst
        src = np.concatenate([s[f:] for (_, s, _), f in zip(self._entries, firsts)])
        dst = np.concatenate([d[f:] for (_, _, d), f in zip(self._entries, firsts)])
        return src, dst


class InlinePeerStep(PeerStep):
    """A step's only peer: its work runs on the sender thread, with nothing to keep
    apart (a lane's thread and hand-offs cost ~0.5 ms per 16-layer step on 2 cores)."""

    def start(self) -> "InlinePeerStep":
        self._begin()
        return self

    @property
    def running(self) -> bool:
        return False

    def push(self, layer: int, prefetch: Optional[int]) -> None:
        try:
            self._write(layer, prefetch)
        except BaseException as exc:  # the step ends; finish() then concludes nothing
            self.error = exc
            raise

    def finish(self) -> None:
        try:
            if self.error is None:
                self._conclude()
        finally:
            self.peer.drop_prefetch()
            self._digests.discard(self.peer.peer_id)  # left only when the step raised

    def join(self, timeout: Optional[float] = None) -> None:
        pass

    def idle(self) -> None:
        self._handle_revokes()


def lanes_landed(lanes: List[PeerStep], layer: int, default: float) -> Tuple[Optional[float], float]:
    """(when ``layer``'s last slot was staged by any lane or None, when its last write
    returned, ``default`` if no lane wrote it)."""
    staged = [lane.staged[layer] for lane in lanes if layer in lane.staged]
    landed = [lane.landed[layer] for lane in lanes if layer in lane.landed]
    return (max(staged) if staged else None), max(landed, default=default)
