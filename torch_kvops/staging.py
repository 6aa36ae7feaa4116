"""Staging of fragmented layers through registered contiguous buffers.

Mooncake's TCP transport pays per descriptor: thousands of small blocks move at less
than half the speed of the same bytes in one range. When a layer's merged
descriptors are small on average, the producer gathers them into a contiguous slot
of its staging buffer with ``swap_blocks_batch``, writes that slot into the peer's
staging slot as one range, and tells the peer (control channel, after the write
returned) which blocks the slot holds; the peer scatters them into its cache with
``swap_blocks_batch`` and acknowledges, which frees the slot for reuse.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from . import ops
from .transports.base import Transport


@dataclass(frozen=True)
class StagingGrant:
    """A consumer's staging area for one producer, sent in the hello reply."""

    address: int
    slots: int
    slot_blocks: int

    def to_json(self) -> dict:
        return {"address": self.address, "slots": self.slots, "slot_blocks": self.slot_blocks}


def uniform_block(caches: Sequence[torch.Tensor]) -> Optional[torch.Size]:
    """The common block shape when every layer has the same block shape and dtype."""
    first = caches[0]
    if all(c.shape[1:] == first.shape[1:] and c.dtype == first.dtype for c in caches):
        return first.shape[1:]
    return None


def _block_buffer(caches: Sequence[torch.Tensor], blocks: int) -> torch.Tensor:
    return torch.empty((blocks, *caches[0].shape[1:]), dtype=caches[0].dtype, device=caches[0].device)


class ConsumerStaging:
    """Consumer side: one staging area per producer connection, scatter on notice."""

    def __init__(self, caches: Sequence[torch.Tensor], transport: Transport, slot_bytes: int,
                 slots: int) -> None:
        self._caches = list(caches)
        self._transport = transport
        block_bytes = caches[0][0].numel() * caches[0].element_size()
        self._slot_blocks = max(1, slot_bytes // block_bytes)
        self._slots = slots
        self._areas: Dict[str, torch.Tensor] = {}
        self._retired: List[tuple] = []
        self._lock = threading.Lock()

    def grant(self, producer: str) -> StagingGrant:
        """The producer's area (a reconnecting producer gets its old one back)."""
        with self._lock:
            area = self._areas.get(producer)
            if area is None:
                area = _block_buffer(self._caches, self._slot_blocks * self._slots)
                self._transport.register(area.data_ptr(), area.numel() * area.element_size())
                self._areas[producer] = area
        return StagingGrant(area.data_ptr(), self._slots, self._slot_blocks)

    def scatter(self, producer: str, layer: int, slot: int, dst_blocks: List[int]) -> None:
        """Copy slot ``slot`` of ``producer``'s area into ``dst_blocks`` of ``layer``
        (block ids are checked by swap_blocks_batch; the rest here)."""
        area = self._areas[producer]
        if not 0 <= layer < len(self._caches):
            raise ValueError(f"scatter: layer {layer} out of range ({len(self._caches)} layers)")
        if not 0 <= slot < self._slots:
            raise ValueError(f"scatter: slot {slot} out of range ({self._slots} slots)")
        if len(dst_blocks) > self._slot_blocks:
            raise ValueError(f"scatter: {len(dst_blocks)} blocks exceed a slot of {self._slot_blocks}")
        base = slot * self._slot_blocks
        mapping = torch.tensor([[base + k, d] for k, d in enumerate(dst_blocks)], dtype=torch.int64)
        ops.swap_blocks_batch([area], [self._caches[layer]], mapping)

    def release(self, producer: str) -> None:
        """The producer's connection ended: unregister its area at once (no new
        writes), free the memory a minute later (a write in flight may still land)."""
        with self._lock:
            area = self._areas.pop(producer, None)
            now = time.monotonic()
            self._retired = [(t, a) for t, a in self._retired if t > now]
            if area is not None:
                self._retired.append((now + 60.0, area))
        if area is not None:
            self._transport.unregister(area.data_ptr())

    def close(self) -> None:
        with self._lock:
            areas, self._areas = list(self._areas.values()), {}
        for area in areas:
            self._transport.unregister(area.data_ptr())


class ProducerStaging:
    """Producer side for one peer: local slots mirroring the peer's granted slots."""

    def __init__(self, caches: Sequence[torch.Tensor], transport: Transport, grant: StagingGrant) -> None:
        self.grant = grant
        self._caches = list(caches)
        self._transport = transport
        self._buffer = _block_buffer(caches, grant.slots * grant.slot_blocks)
        self._block_bytes = caches[0][0].numel() * caches[0].element_size()
        transport.register(self._buffer.data_ptr(), self._buffer.numel() * self._buffer.element_size())
        self.busy = [False] * grant.slots  # waiting for the peer's ack
        self._next = 0

    def next_slot(self) -> int:
        slot = self._next
        self._next = (self._next + 1) % self.grant.slots
        return slot

    def gather(self, layer: int, slot: int, src_blocks: np.ndarray):
        """Copy ``src_blocks`` of ``layer`` into ``slot``; return the one descriptor
        (src address, dst address, length) that moves the slot to the peer."""
        base = slot * self.grant.slot_blocks
        n = int(src_blocks.size)
        mapping = torch.from_numpy(np.stack([src_blocks, np.arange(base, base + n)], axis=1))
        ops.swap_blocks_batch([self._caches[layer]], [self._buffer], mapping)
        offset = base * self._block_bytes
        return (self._buffer.data_ptr() + offset, self.grant.address + offset, n * self._block_bytes)

    def gather_async(self, layer: int, slot: int, src_blocks: np.ndarray) -> "_Gather":
        """:meth:`gather` on a short-lived thread; ``.result()`` joins it."""
        return _Gather(self, layer, slot, src_blocks)

    def close(self) -> None:
        self._transport.unregister(self._buffer.data_ptr())


class _Gather:
    """One gather running on its own thread (the op releases the GIL while copying)."""

    def __init__(self, staging: ProducerStaging, layer: int, slot: int, src_blocks: np.ndarray) -> None:
        self._value = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(staging, layer, slot, src_blocks),
                                        name="kvops-gather", daemon=True)
        self._thread.start()

    def _run(self, staging, layer, slot, src_blocks) -> None:
        try:
            self._value = staging.gather(layer, slot, src_blocks)
        except BaseException as exc:  # handed to the sender by result()
            self._error = exc

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
