"""Request outcomes, reported once each, and the connector's counters.

Both roles report through a :class:`RequestLedger`: an id is queued for
``get_finished`` at most once, and its outcome is remembered from the moment it is
decided (also while a failure waits out its quarantine), so that late notices, later
chunks of the request or a reused id cannot report it again.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np

log = logging.getLogger(__name__)

# Reported ids remembered to refuse late notices; old ones are forgotten first.
_REMEMBERED_IDS = 100_000
HOLD_POLL_S = 0.05  # how often a held outcome asks whether its transfers still run


@dataclass(frozen=True)
class Hold:
    """Keep a failed request's outcome (and so its source blocks) back while
    ``running()`` says transfers that may read them still run, at most ``cap_s``."""

    running: Callable[[], bool]
    cap_s: float


class ConnectorStats:
    """Counters and per-layer mean wait-for-event / transfer times."""

    def __init__(self, num_layers: int) -> None:
        self.lock = threading.Lock()
        self.counters = dict(bytes_sent=0, layers_sent=0, steps=0, requests_finished=0,
                             requests_failed=0, retries=0, transport_errors=0, orphan_pushes=0,
                             staged_writes=0, chunks_after_failure=0, control_not_owner=0,
                             scatter_refused=0, begin_blocks_refused=0, integrity_failures=0, integrity_us=0,
                             fenced=0, write_lease_ended=0, write_lease_renewals=0, revoked_notices=0,
                             revokes_acknowledged=0, failed_revoked=0, lanes_detached=0)
        self.wait_s = np.zeros(num_layers)
        self.transfer_s = np.zeros(num_layers)
        self.samples = np.zeros(num_layers, dtype=np.int64)

    def add(self, **deltas: int) -> None:
        with self.lock:
            for key, value in deltas.items():
                self.counters[key] = self.counters.get(key, 0) + value

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


class RequestLedger:
    """In-flight requests and their outcomes. ``lock`` also guards the role's own
    request tables, so that "in flight" and "reported" change together."""

    def __init__(self, stats: ConnectorStats) -> None:
        self.lock = threading.Lock()
        self.news = threading.Condition(self.lock)  # notified when an outcome is queued
        self.in_flight: Dict[str, str] = {}  # producer: req_id -> peer id
        self._stats = stats
        self._finished: Set[str] = set()
        self._failed: Set[str] = set()
        # quarantined: (due, req_id, ok, hold or None, when the hold gives up)
        self._delayed: List[Tuple[float, str, bool, Optional[Hold], float]] = []
        self._reported: "OrderedDict[str, bool]" = OrderedDict()  # req_id -> ok
        # consumer: ended requests -> destination blocks of each chunk that landed
        # whole, until drained; then kept for landed_chunks() until the next drain
        self._landed_pending: Dict[str, List[List[int]]] = {}
        self._landed: Dict[str, List[List[int]]] = {}

    def report(self, req_id: str, ok: bool, delay: float = 0.0,
               hold: Optional["Hold"] = None) -> None:
        """Producer: end an in-flight request (no-op if it already ended). With a
        ``delay`` the outcome is held back that long; with a ``hold``, also while its
        ``running()`` says transfers that may read the request's source still run, up to
        its cap (a failed write may still read its source and land, Mooncake#4247)."""
        with self.lock:
            if self.in_flight.pop(req_id, None) is None:
                return
            if delay > 0 or hold is not None:
                now = time.monotonic()
                self._delayed.append((now + delay, req_id, ok, hold, now + (hold.cap_s if hold else 0.0)))
                self._remember_locked(req_id, ok)
                self._count_locked(ok)  # decided now: counted now, reported when released
            else:
                self.record_locked(req_id, ok)

    def _count_locked(self, ok: bool) -> None:
        self._stats.add(**{"requests_finished" if ok else "requests_failed": 1})

    def record_locked(self, req_id: str, ok: bool,
                      landed: Optional[List[List[int]]] = None, counted: bool = False) -> None:
        """Under ``lock``: queue the id for :meth:`drain`, remember it was reported.
        ``landed``: the destination blocks of each chunk of the request that landed
        whole (consumer; :meth:`landed_chunks`)."""
        (self._finished if ok else self._failed).add(req_id)
        self.news.notify_all()
        if landed:
            self._landed_pending[req_id] = landed
        self._remember_locked(req_id, ok)
        if not counted:
            self._count_locked(ok)

    def _remember_locked(self, req_id: str, ok: bool) -> None:
        # finished stays finished: a later use of the id, refused and reported failed,
        # must not make its next use look like a later chunk of a failed request
        self._reported[req_id] = ok or self._reported.get(req_id, False)
        if len(self._reported) > _REMEMBERED_IDS:
            self._reported.popitem(last=False)

    def refuse_locked(self, req_id: str) -> None:
        """Under ``lock``, consumer: remember the id as decided (failed) without
        reporting it: the engine gave up on it before it began, so a ``begin`` for it
        is refused like one for a reported request."""
        self._remember_locked(req_id, False)

    def undrained_locked(self, req_id: str) -> bool:
        """Under ``lock``: decided, and not yet handed out by :meth:`drain`."""
        return (req_id in self._finished or req_id in self._failed
                or any(d[1] == req_id for d in self._delayed))

    def was_reported_locked(self, req_id: str) -> bool:
        return req_id in self._reported

    def outcome_locked(self, req_id: str) -> Optional[bool]:
        """Under ``lock``: True/False once the request's outcome was decided (reported,
        or held in quarantine), None while it is in flight or unknown."""
        return self._reported.get(req_id)

    def drain(self) -> Tuple[Set[str], Set[str]]:
        """(finished, failed) since the last call, including quarantined outcomes now due."""
        now = time.monotonic()
        with self.lock:
            held = []
            for entry in self._delayed:
                due, req_id, ok, hold, cap = entry
                if due > now or (hold is not None and now < cap and hold.running()):
                    held.append(entry)
                    continue
                if hold is not None and now >= cap and hold.running():
                    log.warning("request %s: reported after %.1f s while transfers that may read "
                                "its source still run (the cap)", req_id, hold.cap_s)
                    self._stats.add(quarantine_capped=1)
                self.record_locked(req_id, ok, counted=True)
            self._delayed = held
            finished, failed = self._finished, self._failed
            self._finished, self._failed = set(), set()
            self._landed = {r: self._landed_pending.pop(r) for r in finished | failed
                            if r in self._landed_pending}
        return finished, failed

    def wait_for_news(self, timeout_s: float, busy: Callable[[], bool]) -> bool:
        """Block up to ``timeout_s`` until :meth:`drain` has an outcome to give, or a
        quarantined one falls due; at once if ``busy()`` (called under ``lock``) says
        nothing is in flight and nothing is quarantined. True if an outcome is ready."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while not (self._finished or self._failed) and (self._delayed or busy()):
                # a hold is asked again every HOLD_POLL_S
                wake = min((max(d[0], time.monotonic() + HOLD_POLL_S) if d[3] else d[0]
                            for d in self._delayed), default=deadline)
                wake = min(wake, deadline)
                now = time.monotonic()
                if wake <= now:
                    break
                self.news.wait(wake - now)
            return bool(self._finished or self._failed)

    def landed_chunks(self, req_id: str) -> List[List[int]]:
        """Of a request the last :meth:`drain` reported: the destination blocks of
        each of its chunks that landed whole, in the order they landed."""
        with self.lock:
            return list(self._landed.get(req_id, ()))

    def release_delayed(self) -> None:
        """On close: report quarantined outcomes now (nobody will wait for them)."""
        with self.lock:
            for _, req_id, ok, _, _ in self._delayed:
                self.record_locked(req_id, ok, counted=True)
            self._delayed.clear()
