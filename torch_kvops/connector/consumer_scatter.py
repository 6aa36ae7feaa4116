"""The consumer's staging scatters, run off its control thread (issue 33).

A producer that stages a fragmented layer writes it into its slots of this consumer's
staging area and sends ``scatter``: copy the slot into these destination blocks. The
copy may take long (on CUDA it waits for the connector's stream, up to
``event_timeout_s``), and the control thread serves every producer: run there, one
producer's slow scatter would delay every other producer's answers and notices. So the
copy runs on a :class:`ScatterWorkers` thread, and the control thread goes on.

Two rules keep this as safe as a copy on the control thread:

- **Order.** The producer's session is held while its scatter runs: its later
  messages (a ``chunk`` notice that ends the request, digests the verifier checks) are
  handled only after the copy is complete. Other sessions are not held.
- **The fence.** A request with a scatter into its blocks still running is never
  reported: an end that comes meanwhile (its producer left, its lease or fence
  expired) waits for the copy (``_Incoming.end_after_scatter``), so no byte of it lands
  in blocks the engine has got back.

A part of :class:`~torch_kvops.connector.consumer.ConsumerSide`, as the fence is.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

from ..control import Session
from ..staging import ConsumerStaging
from .ledger import ConnectorStats, RequestLedger

if TYPE_CHECKING:
    from .consumer import _Incoming

log = logging.getLogger(__name__)

SCATTER_WORKERS = 2  # scatters of this many producers run at once; one session's run in order

Done = Callable[[Optional[BaseException]], None]


class ScatterWorkers:
    """A few threads that run copies and hand each outcome to ``post`` (the control
    server's ``call_soon``), so that ``done(error)`` runs on the control thread.
    Started on first use; :meth:`close` stops them."""

    def __init__(self, post: Callable[[Callable[[], None]], None], workers: int = SCATTER_WORKERS) -> None:
        self._post, self._workers = post, workers
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, copy: Callable[[], None], done: Done) -> None:
        with self._lock:
            if len(self._threads) < self._workers:
                thread = threading.Thread(target=self._run, name="kvops-scatter", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._queue.put((copy, done))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            copy, done = job
            error: Optional[BaseException] = None
            try:
                copy()
            except Exception as exc:  # the producer's failure: done() drops its session
                error = exc
            self._post(lambda done=done, error=error: done(error))

    def close(self, timeout: float) -> bool:
        """Stop the threads once the copies queued before are done; False if one is
        still running after ``timeout``."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)


class ConsumerScatter:
    """Scatter notices: checked on the control thread, copied by a worker (mixed into
    ConsumerSide)."""

    # set by ConsumerSide.__init__
    _ledger: RequestLedger
    _stats: ConnectorStats
    _incoming: "Dict[str, _Incoming]"
    _owned_blocks: Dict[Session, Dict[int, str]]
    _staging: Optional[ConsumerStaging]
    _scatters: ScatterWorkers

    def _end_locked(self, req_id: str, ok: bool, trust_landed: bool = True) -> None:
        raise NotImplementedError  # ConsumerSide's

    def _scatter(self, message: dict, session: Session, dst: List[int]) -> None:
        layer, slot = int(message["layer"]), int(message["slot"])
        copy = self._staging.scatter_job(session.producer, layer, slot, dst)  # raises on bad values
        with self._ledger.lock:
            targets = self._live_owners_locked(session, dst)
            for entry in (targets or {}).values():
                entry.scattering += 1
        if targets is None:
            # Blocks of no request this session has in flight (its lease expired and
            # the engine may have reused them, or another producer's): never move
            # bytes there. The ack frees the slot; the request is not finished here.
            self._stats.add(scatter_refused=1)
            log.warning("producer %s: scatter into blocks of no request it has in flight: refused",
                        session.producer)
            session.reply({"op": "ack", "slot": slot, "refused": True})
            return
        session.hold()
        try:
            self._scatters.submit(copy, lambda error: self._scattered(session, slot, targets, error))
        except RuntimeError as exc:  # no worker thread could start: nothing runs, nothing waits
            self._scattered(session, slot, targets, exc)

    def _live_owners_locked(self, session: Session, blocks: List[int]) -> "Optional[Dict[str, _Incoming]]":
        """The live (not revoked) requests of the session that own ``blocks``; None if
        a block belongs to none of them."""
        owned = self._owned_blocks.get(session, {})
        targets = {}
        for block in blocks:
            req_id = owned.get(block, "")
            entry = self._incoming.get(req_id)
            if entry is None or not entry.live:
                return None
            targets[req_id] = entry
        return targets

    def _scattered(self, session: Session, slot: int, targets: "Dict[str, _Incoming]",
                   error: Optional[BaseException]) -> None:
        """Control thread, the copy done: end what waited for it, answer, resume."""
        with self._ledger.lock:
            for req_id, entry in targets.items():
                entry.scattering -= 1
                if not entry.scattering and entry.end_after_scatter is not None:
                    self._end_locked(req_id, *entry.end_after_scatter)
        if error is not None:
            log.warning("producer %s: a scatter into its blocks failed: %s", session.producer, error)
            session.drop(f"scatter failed: {error}")  # its requests fail (under the fence)
            return
        session.reply({"op": "ack", "slot": slot})
        session.resume()

    @staticmethod
    def _end_waits_for_scatter_locked(entry: "_Incoming", ok: bool, trust_landed: bool) -> bool:
        """Under the ledger lock, from ``_end_locked``: a scatter into the request's
        blocks still runs, so it is revoked now and reported once the copy is done."""
        if not entry.scattering:
            return False
        entry.end_after_scatter = (ok, trust_landed)
        entry.fenced_until = math.inf
        return True
