"""Which registered regions transfers still read, and the transfers writes left behind.

A ``write()`` pins the registered source regions of its pieces while it runs, so that
``unregister()`` waits instead of letting Mooncake read memory that was handed back.
Mooncake cannot cancel a submitted transfer (Mooncake#4247): the pieces still in
flight when a write fails or times out become *orphans*, each pinning its region until
Mooncake reports it finished. ``unregister()`` and ``close()`` reap the orphans and
wait (bounded) for the pins to go.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

from .engine import PENDING

__all__ = ["SourcePins"]


class SourcePins:
    """Pin counts per registered region and the orphaned transfers holding pins.

    Guarded by the transport's lock: every method expects the caller to hold ``cond``;
    dropping a region's last pin notifies it (``unregister()`` waits on it)."""

    def __init__(self, cond: threading.Condition):
        self._cond = cond
        self._count: Dict[int, int] = {}           # region ptr -> in-flight users
        self._orphans: List[Tuple[int, int, str]] = []  # (batch id, region ptr, peer) of abandoned writes

    def pin_locked(self, region: int) -> None:
        """One more transfer (or write) reads ``region``."""
        self._count[region] = self._count.get(region, 0) + 1

    def unpin_locked(self, region: int, count: int = 1) -> None:
        """``count`` readers of ``region`` are done; wake waiters when none is left."""
        left = self._count.get(region, 0) - count
        if left > 0:
            self._count[region] = left
        else:
            self._count.pop(region, None)
            self._cond.notify_all()

    def users_locked(self, region: int) -> int:
        """How many transfers or writes still read ``region``."""
        return self._count.get(region, 0)

    def forget_locked(self, region: int) -> None:
        """Drop ``region``'s entry (it is being unregistered and has no users)."""
        self._count.pop(region, None)

    def orphan_locked(self, batch_id: int, region: int, peer: str) -> None:
        """A transfer a failed or timed-out write to ``peer`` left behind: it reads
        ``region`` until Mooncake reports it finished."""
        self._orphans.append((batch_id, region, peer))
        self.pin_locked(region)

    def reap_locked(self, engine: Any) -> None:
        """Poll the orphans; release the pins of those that ended."""
        if not self._orphans or engine is None:
            return
        still = []
        for bid, region, peer in self._orphans:
            if engine.transfer_check_status(bid) == PENDING:
                still.append((bid, region, peer))
            else:  # done, failed or timed out: nothing reads the source any more
                self.unpin_locked(region)
        self._orphans = still

    def orphans_locked(self, peer: Optional[str] = None) -> int:
        """How many orphans (toward ``peer``, or any) were still running at the last reap."""
        return sum(peer is None or o[2] == peer for o in self._orphans)

    def clear_locked(self) -> None:
        """Forget everything (the engine is being destroyed, which ends its transfers)."""
        self._count.clear()
        self._orphans.clear()
