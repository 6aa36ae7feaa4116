"""The producer's link to one consumer: its control channel, bounded writes with
retries, and the staging of fragmented layers through the consumer's granted slots."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from ..control import ControlClient
from ..plan import KVLayout
from ..staging import ProducerStaging
from ..transports.base import Transport, TransportError
from .config import ConnectorConfig
from .integrity import BlockDigester
from .ledger import ConnectorStats, Hold

log = logging.getLogger(__name__)


class PeerFailed(Exception):
    """This step cannot use the peer any more; ``str(exc)`` is the reason."""


class PeerLink:
    """One consumer as seen by the producer's sender thread. ``dead`` holds the reason
    once the peer is given up on; later steps fail its requests without writing."""

    def __init__(self, peer_id: str, layout: KVLayout, data_address: str, control: ControlClient,
                 transport: Transport, config: ConnectorConfig, stats: ConnectorStats,
                 stop: threading.Event) -> None:
        self.peer_id = peer_id
        self.layout = layout
        self.data_address = data_address
        self.control = control
        self.staging: Optional[ProducerStaging] = None
        # Device caches on either side: every layer goes through host staging, so the
        # transport never touches device memory (see staging.py).
        self.stage_every_layer = False
        self.dead: Optional[str] = None
        # The write lease of the current step (monotonic clock): no write starts after
        # it. It counts the consumer's grant from before ``begin`` was sent, so it ends
        # no later than the consumer's lease does (docs/connector.md, "The fence").
        self.write_until, self.write_grant_s = 0.0, 0.0  # and the last grant's length
        # Requests the consumer revoked (it gave up on them), not yet acknowledged
        self.revoked: Set[str] = set()
        self.last_used = time.monotonic()  # the last begin (release_peers)
        # Set when this link sends digests of what it pushed (integrity.py).
        self.digester: Optional[BlockDigester] = None
        # (layer, claimed slots, gather) started while the previous layer was on the wire
        self._prefetched: Optional[tuple] = None
        self._transport = transport
        self._config = config
        self._stats = stats
        self._stop = stop

    # ------------------------------------------------------------------ control channel

    def give_up(self, reason: str) -> PeerFailed:
        """Mark the peer dead; returns the exception for the caller to raise."""
        log.error("giving up on peer %s: %s", self.peer_id, reason)
        self.dead = reason
        return PeerFailed(reason)

    def send(self, message: dict) -> None:
        """Send a control message; a broken channel makes the peer dead."""
        try:
            self.control.send(message)
        except ConnectionError as exc:
            self.dead = self.dead or f"control channel failed: {exc}"
            raise PeerFailed(self.dead) from exc

    def begin(self, dst_blocks: Dict[str, np.ndarray]) -> set:
        """Announce a step's requests with the blocks each fills (the consumer lets this
        connection scatter only into those); the consumer answers with those it does not
        accept (already reported failed, e.g. its lease expired, or begun by another
        producer)."""
        sent_at = self.last_used = time.monotonic()
        self.write_until = 0.0
        self.send({"op": "begin", "reqs": list(dst_blocks),
                   "dst": {req_id: dst.tolist() for req_id, dst in dst_blocks.items()}})
        answer = self._receive_until(lambda m: m.get("op") == "begun",
                                     self._config.begin_answer_timeout_s)
        if answer is None:
            # a late answer would be taken for the next begin's: the channel is out of
            # step, so the link is given up (and connected again later, afresh)
            raise self.give_up(self.dead or "no answer to begin within begin_timeout_s")
        grant = answer.get("grant_s")
        if type(grant) not in (int, float) or not 0 <= grant < float("inf"):
            raise PeerFailed(f"the consumer's answer to begin grants no valid write lease: {grant!r}")
        rejected = answer.get("rejected", [])
        # only requests of this begin: a consumer cannot fail another consumer's requests
        if not isinstance(rejected, list) or not all(isinstance(r, str) and r in dst_blocks
                                                         for r in rejected):
            raise self.give_up(f"malformed answer to begin (rejected: {str(rejected)[:200]})")
        self.write_until, self.write_grant_s = sent_at + grant, float(grant)
        return set(rejected)

    def write_lease_renewable(self) -> bool:
        """Less than half of the step's write lease is left, but some (peer_step.py)."""
        return 0.0 < self.write_until - time.monotonic() < self.write_grant_s / 2

    def notify_failed(self, req_id: str, reason: Optional[str]) -> None:
        """Best effort: a broken channel fails at once (its socket is closed), and the
        consumer's lease covers a notice that never arrives. Sent once no more writes
        start for the request; ``in_flight`` tells the consumer whether a failed write
        may still land (it then fences the blocks, docs/connector.md)."""
        try:
            self.send({"op": "failed", "req": req_id, "reason": reason,
                       "in_flight": self.writes_may_be_in_flight()})
        except PeerFailed:
            log.warning("failure notice for %s not delivered to %s: %s", req_id, self.peer_id, self.dead)

    def check_write_lease(self, what: str) -> None:
        """Refuse to start a write (or a scatter) once the step's write lease ended by
        this side's clock: the consumer may have given the blocks back to its engine.
        Fails the step for this peer without marking it dead."""
        if time.monotonic() >= self.write_until:
            self._stats.add(write_lease_ended=1)
            raise PeerFailed(f"write lease ended before {what}: the consumer may have released "
                             f"the blocks")

    def writes_may_be_in_flight(self) -> bool:
        """True while transfers that failed or timed-out writes to this peer left behind
        still run, by the transport's own tracking: they may still read their sources
        and land at the peer (Mooncake#4247)."""
        return self._transport.outstanding(self.data_address) > 0

    def quarantine(self) -> Optional[Hold]:
        """How long a request that ends now keeps its source blocks: while this peer's
        left-behind transfers run, at most ``quarantine_s`` (then logged and counted,
        ``quarantine_capped``); None if none runs. The consumer's fence, not this,
        keeps a late byte out of blocks it handed back."""
        if not self.writes_may_be_in_flight():
            return None
        return Hold(self.writes_may_be_in_flight, self._config.quarantine_s)

    def _receive_until(self, done: Callable[[dict], bool],
                       timeout_s: Optional[float] = None) -> Optional[dict]:
        """Read the peer's messages (staging acks are handled on the way) until
        ``done(message)``, at most ``timeout_s`` (the transfer timeout by default);
        None on timeout, close, or a broken channel."""
        deadline = time.monotonic() + (self._config.transfer_timeout_s if timeout_s is None else timeout_s)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.is_set():
                return None
            try:
                message = self.control.receive(min(remaining, 0.1))
            except ConnectionError as exc:
                self.dead = self.dead or f"control channel failed: {exc}"
                return None
            if message is None:
                continue
            self._note(message)
            if self.dead:
                return None
            if done(message):
                return message

    def poll(self) -> None:
        """Between steps: read what the consumer sent meanwhile (revokes), without
        waiting; a broken channel makes the peer dead."""
        while not self.dead:
            try:
                message = self.control.receive(0.0)
            except ConnectionError as exc:
                self.dead = f"control channel failed: {exc}"
                return
            if message is None:
                return
            self._note(message)

    def acknowledge_revokes(self) -> Set[str]:
        """Tell the consumer we write nothing more of the requests it revoked, and
        whether a failed write to it may still land; returns those requests."""
        revoked, self.revoked = self.revoked, set()
        for req_id in sorted(revoked):
            try:
                self.send({"op": "revoked", "req": req_id, "in_flight": self.writes_may_be_in_flight()})
            except PeerFailed:
                break  # the consumer's fence bound covers the rest
        return revoked

    def _note(self, message: dict) -> None:
        """Handle what may arrive at any time: staging acks and revokes. A malformed one
        makes the peer dead (its requests fail), never raises."""
        op = message.get("op")
        if op == "revoke" and isinstance(message.get("req"), str):
            self.revoked.add(message["req"])
        if op == "ack":
            slot = message.get("slot")
            if self.staging is None or type(slot) is not int or not 0 <= slot < self.staging.grant.slots:
                self.give_up(f"staging ack for a slot it does not have: {str(slot)[:50]}")
                return
            self.staging.busy[slot] = False
            if message.get("refused"):
                # The consumer no longer has a request of ours there (lease expired):
                # it did not move the bytes and will not report the request finished.
                self._stats.add(scatter_refused=1)
                log.warning("peer %s refused a scatter into blocks of a request it no longer "
                            "has in flight", self.peer_id)

    # ------------------------------------------------------------------ data

    def write_layer(self, layer: int, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                    src, dst, lengths, prefetch: Optional[int] = None) -> Tuple[int, Optional[float]]:
        """Move one layer's blocks: through staging when device caches are involved or
        the layer is fragmented (and the peer granted slots), else the merged
        descriptors directly. ``prefetch``: a layer whose KV write is complete, with the
        same blocks (one step): its first slots are gathered while this layer's last
        slots are on the wire. Returns (retries made, when the last slot was staged or
        None on the direct path)."""
        fragmented = lengths.size > 1 and lengths.mean() < self._config.staging_threshold_bytes
        if self.staging is not None and (self.stage_every_layer or fragmented):
            try:
                return self._write_staged(layer, src_blocks, dst_blocks, prefetch)
            except (TimeoutError, RuntimeError) as exc:  # a gather that failed or hung
                raise self.give_up(f"staging layer {layer} failed: {exc}") from exc
        retries = self._write(layer, src, dst, lengths)  # numpy: no list round trip
        self._stats.add(bytes_sent=int(lengths.sum()))
        return retries, None

    def _write(self, layer: int, src, dst, lengths) -> int:
        attempt = 0
        while True:
            self.check_write_lease(f"layer {layer}'s write")
            if self.control.peer_closed():  # each attempt: the consumer died or dropped us
                raise self.give_up(f"peer closed its control channel before layer {layer}'s write")
            try:
                self._transport.write(self.data_address, src, dst, lengths,
                                      timeout_s=self._config.transfer_timeout_s)
                return attempt
            except TransportError as exc:
                self._stats.add(transport_errors=1)
                if not exc.transient or attempt >= self._config.max_retries or self._stop.is_set():
                    raise self.give_up(f"layer {layer} write failed: {exc}") from exc
                attempt += 1
                self._stats.add(retries=1)
                log.warning("retrying layer %d to %s (attempt %d): %s", layer, self.peer_id, attempt, exc)
                time.sleep(self._config.retry_backoff_s * (2 ** (attempt - 1)))

    def _write_staged(self, layer: int, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                      prefetch: Optional[int]) -> Tuple[int, float]:
        """Group by group of slots: gather, write, scatter notices. The next group is
        gathered while the current group is on the wire (both release the GIL), across
        layers too (``prefetch``). A group is half the granted slots, written in one
        call: one slot alone keeps only part of the transport's parallel lanes busy
        (docs/benchmarks.md: fresh random 16 KiB blocks, 4 layers: slot by slot 0.26x
        of contiguous, 2 of 4 slots per write 0.43x, 4 of 8 slots 0.6-1.0x)."""
        staging = self.staging
        per_slot = staging.grant.slot_blocks
        per_group = staging.grant.slots // 2
        starts = list(range(0, src_blocks.size, per_slot))
        groups = [starts[g:g + per_group] for g in range(0, len(starts), per_group)]
        retries = 0
        staged_at = 0.0

        def gather_group(of_layer: int, group: List[int]):
            claimed = [(self._claim_slot(), start) for start in group]
            return claimed, staging.gather_async(
                of_layer, [(slot, src_blocks[start:start + per_slot]) for slot, start in claimed])

        pending = None  # the next group: ([(slot, first block index)], gather)
        try:
            if self._prefetched is not None and self._prefetched[0] == layer:
                pending, self._prefetched = self._prefetched[1:], None
            else:
                self.drop_prefetch()
                pending = gather_group(layer, groups[0])
            for following in groups[1:] + [None]:
                (claimed, gather), pending = pending, None
                descs = gather.result()
                staged_at = time.perf_counter()
                if following is not None:
                    pending = gather_group(layer, following)
                elif prefetch is not None:
                    self._prefetched = (prefetch, *gather_group(prefetch, groups[0]))
                retries += self._write(layer, [d[0] for d in descs], [d[1] for d in descs],
                                       [d[2] for d in descs])
                for (slot, start), desc in zip(claimed, descs):
                    self._stats.add(bytes_sent=desc[2], staged_writes=1)
                    self.check_write_lease(f"layer {layer}'s scatter")
                    staging.busy[slot] = True
                    self.send({"op": "scatter", "layer": layer, "slot": slot,
                               "dst": dst_blocks[start:start + per_slot].tolist()})
        finally:
            # Never leave a copy running into a buffer about to be released; a failure
            # here is logged, so it cannot hide the error that ended the loop.
            if pending is not None:
                self._settle(pending[1], layer)
        return retries, staged_at

    def drop_prefetch(self) -> None:
        """Wait for and discard a gather started for a layer that will not be written
        to this peer (the step ended or the peer failed): its slots are reused."""
        if self._prefetched is not None:
            layer, _, gather = self._prefetched
            self._prefetched = None
            self._settle(gather, layer)

    def _settle(self, gather, layer: int) -> None:
        try:
            gather.result()
        except Exception:
            log.exception("peer %s: a staging gather of layer %d failed", self.peer_id, layer)

    def _claim_slot(self) -> int:
        """The next staging slot, once the peer has released it (ack)."""
        slot = self.staging.next_slot()
        if self.staging.busy[slot]:
            waited_from = time.perf_counter()
            released = self._receive_until(lambda m: not self.staging.busy[slot]) is not None
            self._stats.add(staging_waits=1, staging_wait_s=time.perf_counter() - waited_from)
            if not released:
                raise self.give_up(f"staging slot {slot} was not released in time")
        return slot

    def close(self) -> None:
        self.drop_prefetch()
        self.control.close()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
