"""The consumer's side of the fence (docs/connector.md, "The fence").

Every ``begun`` grants the producer a write lease of
``lease_s``, which the producer counts from before it sent ``begin`` and so ends, by
its clock, no later than this side's lease does. A request given up on while its
producer may still write (its lease expired, its producer's connection ended, a
failure notice that says writes may be in flight, an integrity failure mid-push) is
*revoked*: no notice, begin or scatter for it is accepted any more, and its blocks
stay out of the engine's hands (``fenced`` counts them) until ``fence_drain_s`` after
the later of now and the end of its write lease. Only then is it reported failed,
unless the producer answers the ``revoke`` this side sends it first: ``revoked`` says
it writes no more of the request and whether a failed write of it may still land; if
none may, the request is reported at once.

A part of :class:`~torch_kvops.connector.consumer.ConsumerSide`, kept apart because it
is one job: it reads the connector's request table (``_incoming``, under the ledger
lock) and ends requests through its ``_end_locked``.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Dict

from ..control import Session
from .config import ConnectorConfig
from .ledger import ConnectorStats, RequestLedger

if TYPE_CHECKING:
    from .consumer import _Incoming

log = logging.getLogger(__name__)


class ConsumerFence:
    """Revoking, fencing and reporting given-up requests (mixed into ConsumerSide)."""

    # set by ConsumerSide.__init__
    _config: ConnectorConfig
    _ledger: RequestLedger
    _stats: ConnectorStats
    _incoming: "Dict[str, _Incoming]"

    def _end_locked(self, req_id: str, ok: bool, trust_landed: bool = True) -> None:
        raise NotImplementedError  # ConsumerSide's

    @property
    def fenced(self) -> int:
        """Requests revoked but not yet reported: their blocks wait for the fence."""
        with self._ledger.lock:
            return sum(not entry.live for entry in self._incoming.values())

    def refuse(self, req_ids) -> None:
        """The engine gave up on these before they began (e.g. its post to the producer
        timed out, and the producer may still have accepted it): a ``begin`` for any of
        them is refused, so nothing is written into blocks the engine reuses."""
        with self._ledger.lock:
            for req_id in req_ids:
                if req_id not in self._incoming:
                    self._ledger.refuse_locked(req_id)

    def _give_up_locked(self, req_id: str, writes_may_land: bool = True, after_grant: bool = True,
                        trust_landed: bool = True) -> None:
        """Under the ledger lock: fail the request now if no write of its producer can
        still land, else revoke it and report it once the fence ends: ``fence_drain_s``
        after now, or after its write lease ends if the producer may still start writes
        (``after_grant``: it has not said it stopped)."""
        entry = self._incoming[req_id]
        if entry.owner is None or not writes_may_land:
            self._end_locked(req_id, ok=False, trust_landed=trust_landed)
            return
        start = max(time.monotonic(), entry.granted_until) if after_grant else time.monotonic()
        entry.fenced_until = start + self._config.fence_drain_s
        entry.trust_landed = trust_landed
        self._stats.add(fenced=1)
        log.warning("request %s revoked: reported failed in %.1f s, when no write of producer %s "
                    "for it can still land", req_id, entry.fenced_until - time.monotonic(),
                    entry.owner.producer)

    def _revoke_acknowledged(self, req_id: str, in_flight, session: Session) -> None:
        """The producer stopped writing a revoked request: report it now if no failed
        write of it may still land, else ``fence_drain_s`` from now at the latest."""
        with self._ledger.lock:
            entry = self._incoming.get(req_id)
            if entry is None:  # its fence ended first (the producer was frozen, say)
                log.info("late acknowledgement of the revoke of %s from producer %s", req_id,
                         session.producer)
                return
            if entry.live or entry.owner is not session:
                self._stats.add(control_not_owner=1)
                log.warning("producer %s acknowledged a revoke of %s it was not sent", session.producer, req_id)
                return
            self._stats.add(revokes_acknowledged=1)
            if in_flight is False:
                self._end_locked(req_id, ok=False, trust_landed=entry.trust_landed)
            else:
                entry.fenced_until = min(entry.fenced_until, time.monotonic() + self._config.fence_drain_s)

    def _expire_leases(self) -> None:
        """Control server thread, every tick: give up on expired leases, report revoked
        requests whose fence ended, and ask producers to stop revoked requests (sent
        outside the ledger lock: a failed send drops the session, which takes it)."""
        self._answer_held_begins()
        now = time.monotonic()
        revokes = []
        with self._ledger.lock:
            for req_id, entry in list(self._incoming.items()):
                if entry.live and entry.deadline < now and not entry.verifying:
                    log.warning("request %s: lease expired before it finished", req_id)
                    self._stats.add(failed_lease_expired=1)
                    self._give_up_locked(req_id)
                if entry.live or self._incoming.get(req_id) is not entry:
                    continue
                if entry.fenced_until < now:
                    self._end_locked(req_id, ok=False, trust_landed=entry.trust_landed)
                elif not entry.revoke_sent:
                    entry.revoke_sent = True
                    revokes.append((entry.owner, req_id))
        for session, req_id in revokes:
            session.reply({"op": "revoke", "req": req_id})
