"""A circuit breaker per peer: after a failure, the next attempt to connect waits a
bounded, jittered backoff that doubles with each failure in a row; a success closes
it. Used by engine adapters that connect peers on demand (a link that broke is
connected again when a request needs it, never hammered at every chunk)."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable, Dict


@dataclass
class _Open:
    failures: int
    retry_at: float
    reason: str


class PeerBreaker:
    """``may_try(key)`` before connecting; ``failed(key, reason)`` or ``closed(key)``
    after. ``base_s`` is the first backoff, ``cap_s`` the longest; each is scaled by a
    random factor in [0.5, 1] so that many producers do not retry in step."""

    def __init__(self, base_s: float = 0.5, cap_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random = None) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {base_s}, {cap_s}")
        self._base_s, self._cap_s, self._clock = base_s, cap_s, clock
        self._rng = rng or random.Random()
        self._open: Dict[str, _Open] = {}

    def may_try(self, key: str) -> bool:
        state = self._open.get(key)
        return state is None or self._clock() >= state.retry_at

    def failed(self, key: str, reason: str) -> float:
        """One more failure in a row; returns the backoff before the next attempt."""
        failures = self._open[key].failures + 1 if key in self._open else 1
        backoff = min(self._cap_s, self._base_s * 2 ** (failures - 1)) * self._rng.uniform(0.5, 1.0)
        self._open[key] = _Open(failures, self._clock() + backoff, reason)
        return backoff

    def closed(self, key: str) -> None:
        self._open.pop(key, None)

    def forget_stale(self, idle_s: float) -> None:
        """Drop the open breakers whose next attempt was due more than ``idle_s`` ago and
        not made (no request needed the peer since: a peer gone for good, a D that was
        restarted under a new id), so they do not pile up."""
        now = self._clock()
        for key in [k for k, s in self._open.items() if now - s.retry_at > idle_s]:
            del self._open[key]

    def __len__(self) -> int:
        """Open breakers (peers backing off)."""
        return len(self._open)

    def states(self) -> Dict[str, dict]:
        """Open breakers: failures in a row, seconds until the next attempt, why."""
        now = self._clock()
        return {key: {"failures": s.failures, "retry_in_s": max(0.0, s.retry_at - now), "reason": s.reason}
                for key, s in self._open.items()}
