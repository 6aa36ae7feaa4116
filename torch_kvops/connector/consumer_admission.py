"""The consumer's admission of ``begin``: which requests a producer may start writing.

A begin naming a request nobody expected is not answered until ``expect()`` names it,
at most ``ConnectorConfig.begin_waits_for_expect_s`` (0 by default: the next tick of
the control thread; the engine adapters wait 10 s, since an engine learns of a request
it asked for a little after its producer may: a post travels faster than the engine's
next step), and a request still unknown then is rejected, so its producer writes
nothing. Without it, a producer with a stale or wrong id would write into blocks the
engine gave to some other request. ``accept_unsolicited_pushes=True`` lets a begin
start a request the consumer was never told to expect, for callers that skip
``expect()``. Every wait here is on the control thread's tick; the producer waits
for the answer (its own timeout, ``begin_timeout_s``, must be longer). The write lease
granted with the answer counts the hold as well: the producer counts its lease from
before it sent the begin.

A part of :class:`~torch_kvops.connector.consumer.ConsumerSide`, kept apart because it
is one job: it reads the request table (``_incoming``, under the ledger lock) and
answers through ConsumerSide's ``_answer_begin``.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Dict, List, Tuple

from ..control import Session
from .config import ConnectorConfig
from .ledger import ConnectorStats, RequestLedger

if TYPE_CHECKING:
    from .consumer import _Incoming

log = logging.getLogger(__name__)


class BeginAdmission:
    """Held begins for requests not yet expected (mixed into ConsumerSide)."""

    # set by ConsumerSide.__init__
    _config: ConnectorConfig
    _ledger: RequestLedger
    _stats: ConnectorStats
    _incoming: Dict[str, "_Incoming"]
    _held_begins: List[Tuple[float, float, dict, Session]]  # (deadline, arrival, ...)

    def _answer_begin(self, message: dict, session: Session, unexpected: List[str],
                      held_s: float = 0.0) -> None:
        raise NotImplementedError  # ConsumerSide's

    def _unexpected_locked(self, message: dict) -> List[str]:
        """The requests of a begin that nobody expected and that never ended here."""
        return [str(r) for r in message["reqs"]
                if str(r) not in self._incoming and not self._ledger.was_reported_locked(str(r))]

    def _admit_begin(self, message: dict, session: Session) -> None:
        """Answer a begin now, or hold it while it names requests not yet expected."""
        if self._config.accept_unsolicited_pushes:
            self._answer_begin(message, session, [])
            return
        with self._ledger.lock:
            waiting = bool(self._unexpected_locked(message))
            if waiting:
                now = time.monotonic()
                self._held_begins.append((now + self._config.begin_waits_for_expect_s, now,
                                          message, session))
        if not waiting:
            self._answer_begin(message, session, [])

    def _answer_held_begins(self) -> None:
        """Control thread, every tick: answer each held begin whose requests are all
        expected now, or whose wait ended (rejecting those still unknown)."""
        if not self._held_begins:
            return
        now, ready = time.monotonic(), []
        with self._ledger.lock:
            held, self._held_begins = self._held_begins, []
            for deadline, arrival, message, session in held:
                unexpected = self._unexpected_locked(message)
                if unexpected and deadline > now:
                    self._held_begins.append((deadline, arrival, message, session))
                else:
                    ready.append((message, session, unexpected, now - arrival))
        for message, session, unexpected, held_s in ready:
            if unexpected:
                log.warning("producer %s: begin for %s, which this consumer never expected "
                            "within %.1f s: rejected", session.producer, sorted(unexpected), held_s)
                self._stats.add(failed_begin_unexpected=len(unexpected))
            try:
                self._answer_begin(message, session, unexpected, held_s)
            except Exception as exc:  # its fields were checked on arrival: a bug, its session's
                log.exception("producer %s: answering its held begin failed", session.producer)
                session.drop(f"answering its held begin failed: {exc}")

    def _drop_held_begins(self, session: Session) -> None:
        """The session ended: nobody waits for its held begins."""
        with self._ledger.lock:
            self._held_begins = [h for h in self._held_begins if h[3] is not session]
