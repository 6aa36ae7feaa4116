"""Memory registration with the Mooncake engine and the index of registered regions.

Mooncake's TCP transport does not check that a write's *source* range is registered (it
simply reads the pointer), so the transport keeps its own sorted index of what it
registered and checks every source range against it (:mod:`.descriptors`). The same
fact lets a region that is only ever a write *source* stay out of Mooncake on TCP
(``exposed=False``): Mooncake's TCP server serves reads as well as writes of every
region registered with it to any peer that completes its unauthenticated handshake,
so a producer's KV cache registered there could be read by anyone who reaches the
port. RDMA needs every local buffer registered (the NIC reads it through its key).
Registering runs the Mooncake call outside the transport's lock, so a long registration
(RDMA pins the pages) does not hold up a ``write()`` on another thread. Unregistering
waits while transfers still read the region (:mod:`.pins`).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

import numpy as np

from ..base import TransportError
from .engine import EngineSlot
from .pins import SourcePins

__all__ = ["RegionIndex", "Registry"]

log = logging.getLogger(__name__)


class RegionIndex:
    """Registered regions (start -> length), sorted for lookups both as Python lists
    (``starts_list``/``ends_list``, for a few descriptors) and as numpy arrays
    (``starts``/``ends``, for many). Not thread-safe: the transport's lock guards it."""

    def __init__(self) -> None:
        self._lengths: Dict[int, int] = {}
        self.starts_list: List[int] = []
        self.ends_list: List[int] = []
        self.starts = np.zeros(0, dtype=np.uint64)
        self.ends = np.zeros(0, dtype=np.uint64)

    def __contains__(self, ptr: int) -> bool:
        return ptr in self._lengths

    def length(self, ptr: int) -> Optional[int]:
        """The length registered at ``ptr``, or None."""
        return self._lengths.get(ptr)

    def ptrs(self) -> List[int]:
        """Every registered start."""
        return list(self._lengths)

    def add(self, ptr: int, length: int) -> None:
        """Index ``[ptr, ptr + length)``."""
        self._lengths[ptr] = length
        self._rebuild()

    def remove(self, ptr: int) -> int:
        """Take the region at ``ptr`` out of the index; returns its length."""
        length = self._lengths.pop(ptr)
        self._rebuild()
        return length

    def clear(self) -> None:
        """Forget every region."""
        self._lengths.clear()
        self._rebuild()

    def _rebuild(self) -> None:
        starts = sorted(self._lengths)
        self.starts_list = starts
        self.ends_list = [s + self._lengths[s] for s in starts]
        self.starts = np.array(self.starts_list, dtype=np.uint64)
        self.ends = np.array(self.ends_list, dtype=np.uint64)


class Registry:
    """Registers and unregisters memory with the engine in ``slot``, keeping ``index``
    in step; ``pins`` tells which regions transfers still read."""

    def __init__(self, slot: EngineSlot, pins: SourcePins, protocol: str):
        self._slot = slot
        self._pins = pins
        self._engine_needs_sources = protocol != "tcp"
        self.index = RegionIndex()
        self._in_engine: set = set()  # starts registered with Mooncake (the rest: index only)

    def register(self, ptr: int, length: int, exposed: bool = True) -> None:
        """Register ``[ptr, ptr + length)`` (idempotent for the same ``ptr`` and ``length``);
        ``exposed=False``: a write source only, kept out of Mooncake where the protocol
        allows (TCP)."""
        ptr, length = int(ptr), int(length)
        if ptr <= 0 or length <= 0:
            raise TransportError(f"cannot register ptr={ptr:#x} length={length}", transient=False)
        slot = self._slot
        with slot.lock:
            slot.check_open_locked()
            known = self.index.length(ptr)
            if known is not None:
                if known == length and (ptr in self._in_engine or not exposed):
                    return
                raise TransportError(f"ptr {ptr:#x} is already registered (length {known}"
                                     f"{', not exposed to peers' if known == length else ''}); "
                                     "unregister it first", transient=False)
            engine = slot.engine
            if not exposed and not self._engine_needs_sources:
                self.index.add(ptr, length)
                return
        # batch_register_memory releases the GIL (register_memory does not).
        rc = engine.batch_register_memory([ptr], [length])
        if rc != 0:
            hint = " (it overlaps a registered region)" if rc == -7 else ""
            raise TransportError(f"Mooncake register_memory({ptr:#x}, {length}) failed with "
                                 f"{rc}{hint}", transient=False)
        with slot.lock:
            if slot.engine is engine and not slot.closed:
                self.index.add(ptr, length)
                self._in_engine.add(ptr)
                return
        engine.batch_unregister_memory([ptr])  # closed meanwhile
        raise TransportError("transport was closed during register()", transient=False)

    def unregister(self, ptr: int, timeout_s: float) -> None:
        """Unregister the region at ``ptr`` (unknown pointers are ignored), waiting up to
        ``timeout_s`` for transfers that read it; a transient TransportError if some
        still do then (the region stays registered)."""
        ptr = int(ptr)
        deadline = time.monotonic() + timeout_s
        slot = self._slot
        with slot.cond:
            if slot.engine is None or ptr not in self.index:
                return
            # Take the region out of the index first, so that new writes cannot use it
            # (and keep pinning it) while we wait for the ones in flight.
            length = self.index.remove(ptr)
            while True:
                if slot.engine is None:
                    return  # close() ran meanwhile: the engine and its registrations are gone
                self._pins.reap_locked(slot.engine)
                users = self._pins.users_locked(ptr)
                if users == 0:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.index.add(ptr, length)  # still registered: put it back
                    raise TransportError(f"region {ptr:#x} is still read by {users} in-flight "
                                         "transfer(s) (a timed-out write may still be moving "
                                         "bytes); keep the memory alive and unregister later",
                                         transient=True)
                slot.cond.wait(min(remaining, 0.01))
            self._pins.forget_locked(ptr)
            engine = slot.engine
            if ptr not in self._in_engine:
                return
            self._in_engine.discard(ptr)
        rc = engine.batch_unregister_memory([ptr])
        if rc != 0:
            raise TransportError(f"Mooncake unregister_memory({ptr:#x}) failed with {rc}",
                                 transient=False)

    def release_all_locked(self, engine: Any) -> None:
        """Unregister every region (at close; problems are logged) and empty the index."""
        regions = [ptr for ptr in self.index.ptrs() if ptr in self._in_engine]
        if regions:
            rc = engine.batch_unregister_memory(regions)
            if rc != 0:
                log.warning("MooncakeTransport.close(): unregister_memory failed with %d", rc)
        self.index.clear()
        self._in_engine.clear()
