"""The write path: one ``write()``'s pieces through Mooncake, and why a failure happened.

:class:`WriteSession` submits one Mooncake batch per piece with
``transfer_submit_write`` and polls ``transfer_check_status``, sleeping between polls,
with a bounded number of pieces and bytes in flight. The alternatives do not fit:
``transfer_check_status`` on a multi-descriptor batch only looks at the batch's first
descriptor (it reports "done" while later descriptors are still moving),
``get_batch_transfer_status`` and the ``*_sync_*`` calls block and spin a core until
Mooncake's own timeout (``MC_TRANSFER_TIMEOUT``, at least 5 s), so they cannot honour a
caller's deadline.

Mooncake reports every failed transfer as -1. :meth:`WriteSession._fail` tells a peer
that rejects the write (permanent) from a dead or hung peer (transient) by probing the
peer's handshake port and re-sending the failed piece once. Pieces still in flight when
the session ends with an error stay in :attr:`WriteSession.inflight`; the transport
turns them into orphans (:mod:`.pins`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, NoReturn, Optional, Tuple

from ..base import TransportError
from .descriptors import Pieces
from .engine import DONE, PENDING, EngineSlot
from .handshake import DIAGNOSIS_S, probe_peer

__all__ = ["Pacing", "WriteSession"]


@dataclass(frozen=True)
class Pacing:
    """How much of one write may be in flight, and how its status is polled (the
    transport's constructor arguments of the same names describe each)."""

    max_batch_descriptors: int
    max_batch_bytes: int
    busy_poll_s: float
    min_poll_interval_s: float
    max_poll_interval_s: float


class WriteSession:
    """The pieces of one ``write()`` to ``peer`` on their way, until ``deadline``.

    ``inflight`` lists (batch id, piece index, region) of the pieces submitted and not
    known to be finished; it is empty after :meth:`run` returns, and what it holds after
    :meth:`run` raised may still be moving bytes."""

    # Mooncake's TCP lanes (4 per peer) serve queued transfers in order, so a transfer
    # behind this many unfinished ones has not started yet: no need to poll it.
    SCAN_DEPTH = 16

    def __init__(self, slot: EngineSlot, peer: str, pieces: Pieces, pacing: Pacing, *,
                 start: float, deadline: float, timeout: float):
        self._slot = slot
        self.peer = peer
        self.src, self.dst, self.lengths, self.regions = pieces
        self.pacing = pacing
        self.start, self.deadline, self.timeout = start, deadline, timeout
        self.inflight: List[Tuple[int, int, int]] = []

    def run(self) -> None:
        """Move every piece; raise TransportError (classified) on failure, timeout or close."""
        peer, pacing, inflight = self.peer, self.pacing, self.inflight
        engine = self._slot.engine
        submit, check = engine.transfer_submit_write, engine.transfer_check_status
        src_l, dst_l, len_l, reg_l = self.src, self.dst, self.lengths, self.regions
        total = len(len_l)
        total_bytes = sum(len_l)
        max_desc, max_bytes = pacing.max_batch_descriptors, pacing.max_batch_bytes
        nxt = 0
        bytes_inflight = 0
        sleep = pacing.min_poll_interval_s
        spin_until = time.monotonic() + pacing.busy_poll_s
        while True:
            # Submit up to the window.
            while nxt < total and len(inflight) < max_desc and (
                    not inflight or bytes_inflight + len_l[nxt] <= max_bytes):
                bid = submit(peer, src_l[nxt], dst_l[nxt], len_l[nxt])
                if bid == 0:
                    self._fail(f"Mooncake refused to submit descriptor {nxt} of {total}")
                inflight.append((bid, nxt, reg_l[nxt]))
                bytes_inflight += len_l[nxt]
                nxt += 1
            # Poll the oldest transfers.
            progressed = False
            pending = 0
            i = 0
            while i < len(inflight) and pending < self.SCAN_DEPTH:
                bid, k, _ = inflight[i]
                st = check(bid)
                if st == DONE:
                    bytes_inflight -= len_l[k]
                    del inflight[i]
                    progressed = True
                elif st == PENDING:
                    pending += 1
                    i += 1
                else:  # FAILED (id freed by Mooncake) or TIMED_OUT (id stays allocated)
                    del inflight[i]
                    done_bytes = sum(len_l[:nxt]) - bytes_inflight
                    self._fail(f"Mooncake reported status {st} for descriptor {k} "
                               f"([{src_l[k]:#x}, +{len_l[k]}) -> {dst_l[k]:#x}) after "
                               f"{time.monotonic() - self.start:.3f}s; {done_bytes} of "
                               f"{total_bytes} bytes confirmed",
                               retry=(src_l[k], dst_l[k], len_l[k], reg_l[k]))
            if nxt >= total and not inflight:
                return
            if self._slot.closed:
                raise TransportError("transport closed during write", transient=False, peer=peer)
            now = time.monotonic()
            if now >= self.deadline:
                done_bytes = sum(len_l[:nxt]) - bytes_inflight
                raise TransportError(
                    f"write to {peer} timed out after {now - self.start:.3f}s "
                    f"(timeout_s={self.timeout}): {done_bytes} of {total_bytes} bytes confirmed, "
                    f"{len(inflight)} descriptor(s) still in flight, {total - nxt} not submitted; "
                    "in-flight bytes may still land later", transient=True, peer=peer)
            if progressed:
                sleep = pacing.min_poll_interval_s
                if nxt < total and len(inflight) < max_desc:
                    continue  # room in the window: submit more right away
            elif now < spin_until:
                continue  # a short write is usually done within tens of microseconds
            else:
                sleep = min(sleep * 2.0, pacing.max_poll_interval_s)
            time.sleep(min(sleep, max(0.0, self.deadline - now)))

    def _fail(self, what: str, retry: Optional[Tuple[int, int, int, int]] = None) -> NoReturn:
        """Raise the TransportError for a failed transfer, classified.

        Mooncake reports every failure as -1. To tell a peer that rejects the write
        (its destination range is not registered there: permanent) from a dead or hung
        peer (worth retrying), check whether the peer's handshake port accepts TCP
        connections and, if it does, write the failed piece (``retry``: src, dst,
        length, region) once more (the very same bytes to the very same place, so
        harmless) and watch it: a prompt failure while the port stays open means the
        peer rejects it, success or silence means the first failure was a connection
        problem. All of this takes at most DIAGNOSIS_S.
        """
        peer = self.peer
        until = time.monotonic() + DIAGNOSIS_S
        why = probe_peer(peer, until)
        if why is not None:
            raise TransportError(f"write to {peer} failed: {what}; the peer's handshake port "
                                 f"refuses connections ({why}) - peer process gone or restarting?",
                                 transient=True, peer=peer)
        if retry is None:
            raise TransportError(f"write to {peer} failed: {what}", transient=True, peer=peer)
        s, d, n, region = retry
        engine = self._slot.engine
        resent_at = time.monotonic()
        bid = engine.transfer_submit_write(peer, s, d, n) if engine is not None else 0
        if bid == 0:
            raise TransportError(f"write to {peer} failed: {what}", transient=True, peer=peer)
        st = engine.transfer_check_status(bid)
        while st == PENDING and time.monotonic() < until - 0.1:
            time.sleep(0.002)
            st = engine.transfer_check_status(bid)
        resend_s = time.monotonic() - resent_at
        if st == PENDING:
            self.inflight.append((bid, -1, region))  # becomes an orphan; same bytes, same place
            raise TransportError(f"write to {peer} failed: {what}; the peer accepts connections but "
                                 "did not complete a re-send of that descriptor either (peer hung or "
                                 "overloaded?)", transient=True, peer=peer)
        if st == DONE:
            raise TransportError(f"write to {peer} failed: {what}; a re-send of that descriptor "
                                 "succeeded, so it was a transient connection problem", transient=True,
                                 peer=peer)
        # A rejection comes back within a round trip. A slow failure, or a handshake port
        # that closed meanwhile, means the peer is going away (a killed process closes
        # its sockets one by one, so the first probe may still have been answered).
        why = probe_peer(peer, until)
        if why is not None or resend_s > 0.3:
            state = f"now refuses connections ({why})" if why else f"took {resend_s:.2f}s to fail it"
            raise TransportError(f"write to {peer} failed: {what}; a re-send failed too and the peer "
                                 f"{state} - peer process gone or restarting?", transient=True,
                                 peer=peer)
        raise TransportError(
            f"write to {peer} failed: {what}; the peer is up and rejected a re-send as well, so the "
            "destination range is most likely not inside one region registered on the peer (if the "
            "peer registers adjacent buffers separately, construct the transport with "
            "merge_descriptors=False)", transient=False, peer=peer)
