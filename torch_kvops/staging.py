"""Staging of fragmented layers through registered contiguous buffers.

Mooncake's TCP transport pays per descriptor: thousands of small blocks move at less
than half the speed of the same bytes in one range. When a layer's merged
descriptors are small on average, the producer gathers them into a contiguous slot
of its staging buffer with ``swap_blocks_batch``, writes that slot into the peer's
staging slot as one range, and tells the peer (control channel, after the write
returned) which blocks the slot holds; the peer scatters them into its cache with
``swap_blocks_batch`` and acknowledges, which frees the slot for reuse.

With CUDA caches every layer goes through staging, whatever its fragmentation: the
slots are pinned host memory, gathers and scatters run on a connector-owned
non-blocking stream and are awaited through their own event (polled, bounded), so the
transport never reads or writes device memory. Mooncake's TCP transport would read
it with a synchronous ``cudaMemcpy`` on the legacy default stream, i.e. behind every
kernel the model has queued there (FIELD-NOTES: 25 ms became 423 ms). The CPU path
runs the same steps, with a short-lived thread in place of the stream.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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

    @classmethod
    def from_consumer(cls, grant, block_bytes: int, max_bytes: int) -> "StagingGrant":
        """A grant as a consumer sent it, checked before it sizes anything here: whole
        numbers, at least two slots of at least one block, and no more mirrored bytes
        than ``max_bytes`` (this producer's own staging budget). ``ValueError`` else."""
        if not isinstance(grant, dict) or set(grant) != {"address", "slots", "slot_blocks"} \
                or any(type(v) is not int for v in grant.values()):
            raise ValueError(f"malformed staging grant: {grant!r}")
        if grant["address"] < 0 or grant["slots"] < 2 or grant["slot_blocks"] < 1:
            raise ValueError(f"staging grant out of range: {grant!r}")
        if grant["slots"] * grant["slot_blocks"] * block_bytes > max_bytes:
            raise ValueError(f"staging grant of {grant['slots']} x {grant['slot_blocks']} blocks is over "
                             f"this producer's staging budget of {max_bytes} bytes")
        return cls(**grant)


def uniform_block(caches: Sequence[torch.Tensor]) -> Optional[torch.Size]:
    """The common block shape when every layer has the same block shape and dtype."""
    first = caches[0]
    if all(c.shape[1:] == first.shape[1:] and c.dtype == first.dtype for c in caches):
        return first.shape[1:]
    return None


def _block_buffer(caches: Sequence[torch.Tensor], blocks: int) -> torch.Tensor:
    """Host memory for ``blocks`` blocks: pinned when the caches live on a device, so
    the copies to and from it are asynchronous DMA (or kernel) copies. Left unwritten
    (``empty``, never ``zeros``): on the host path its pages become resident only where
    slots are written, so a link's staging costs what it moves, not what was granted
    (tests/test_peer_churn.py)."""
    on_device = caches[0].device.type != "cpu"
    return torch.empty((blocks, *caches[0].shape[1:]), dtype=caches[0].dtype, device="cpu",
                       pin_memory=on_device)


class _DeviceCopy:
    """One ``swap_blocks_batch`` issued on the connector's own CUDA stream; ``result``
    polls its event (never the model's stream) and returns ``value`` when it is done."""

    def __init__(self, stream: "torch.cuda.Stream", run, value, timeout_s: float) -> None:
        self._value, self._timeout_s, self._device = value, timeout_s, stream.device
        # Connector threads start on device 0: without selecting the stream's device,
        # leaving the stream context would create a CUDA context on GPU 0.
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            run()
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def result(self):
        deadline = time.monotonic() + self._timeout_s
        pause = 20e-6
        while not self._done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a staging copy on the connector's stream did not finish "
                                   f"within {self._timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return self._value

    def _done(self) -> bool:
        with torch.cuda.device(self._device):
            return self._event.query()


def _drain(stream: Optional["torch.cuda.Stream"]) -> None:
    """Before a staging buffer is unregistered and freed: let copies still running on
    the connector's own stream finish (a timed-out gather may still be writing)."""
    if stream is not None:
        with torch.cuda.device(stream.device):
            stream.synchronize()


def _copy_stream(caches: Sequence[torch.Tensor]) -> Optional["torch.cuda.Stream"]:
    """The connector-owned non-blocking stream for caches on a CUDA device."""
    device = caches[0].device
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


class ConsumerStaging:
    """Consumer side: one staging area per producer connection, scatter on notice."""

    def __init__(self, caches: Sequence[torch.Tensor], transport: Transport, slot_bytes: int,
                 slots: int, copy_timeout_s: float = 60.0) -> None:
        self._caches = list(caches)
        self._stream = _copy_stream(caches)
        self._copy_timeout_s = copy_timeout_s
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

    def scatter_job(self, producer: str, layer: int, slot: int, dst_blocks: List[int]) -> Callable[[], None]:
        """The copy of slot ``slot`` of ``producer``'s area into ``dst_blocks`` of
        ``layer``, checked here and now (block ids are checked by swap_blocks_batch),
        to run on a scatter worker (consumer_scatter.py). It returns once the copy is
        complete, so the slot may be acknowledged and a request that ends after it
        reported finished; on CUDA it runs on the connector's stream, never the decode
        model's."""
        area = self._areas[producer]
        if not 0 <= layer < len(self._caches):
            raise ValueError(f"scatter: layer {layer} out of range ({len(self._caches)} layers)")
        if not 0 <= slot < self._slots:
            raise ValueError(f"scatter: slot {slot} out of range ({self._slots} slots)")
        if len(dst_blocks) > self._slot_blocks:
            raise ValueError(f"scatter: {len(dst_blocks)} blocks exceed a slot of {self._slot_blocks}")
        base = slot * self._slot_blocks
        mapping = torch.tensor([[base + k, d] for k, d in enumerate(dst_blocks)], dtype=torch.int64)
        cache = self._caches[layer]
        copy = lambda: ops.swap_blocks_batch([area], [cache], mapping)  # noqa: E731
        if self._stream is None:
            return copy
        stream, timeout_s = self._stream, self._copy_timeout_s
        return lambda: _DeviceCopy(stream, copy, None, timeout_s).result()

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
        _drain(self._stream)
        with self._lock:
            areas, self._areas = list(self._areas.values()), {}
        for area in areas:
            self._transport.unregister(area.data_ptr())


class ProducerStaging:
    """Producer side for one peer: local slots mirroring the peer's granted slots."""

    def __init__(self, caches: Sequence[torch.Tensor], transport: Transport, grant: StagingGrant,
                 copy_timeout_s: float = 60.0) -> None:
        self.grant = grant
        self._caches = list(caches)
        self._stream = _copy_stream(caches)
        self._copy_timeout_s = copy_timeout_s
        self._transport = transport
        self._buffer = _block_buffer(caches, grant.slots * grant.slot_blocks)
        self._block_bytes = caches[0][0].numel() * caches[0].element_size()
        transport.register(self._buffer.data_ptr(), self._buffer.numel() * self._buffer.element_size(),
                           exposed=False)
        self.busy = [False] * grant.slots  # waiting for the peer's ack
        self._next = 0

    def next_slot(self) -> int:
        slot = self._next
        self._next = (self._next + 1) % self.grant.slots
        return slot

    def gather_async(self, layer: int, pieces: Sequence[Tuple[int, np.ndarray]]):
        """Start gathering each ``(slot, src_blocks)`` of ``pieces`` with ONE
        ``swap_blocks_batch`` (the op spreads it over torch's threads; one Python thread
        per slot oversubscribed the cores). ``.result()`` waits for it ("staged") and
        returns one descriptor (src address, dst address, length) per piece, which
        moves that slot to the peer. CPU: a short-lived thread. CUDA: the
        connector's stream and an event; the caller has waited for the layer's own
        event, so the KV write is complete."""
        bb, slot_blocks = self._block_bytes, self.grant.slot_blocks
        rows, descs = [], []
        for slot, src_blocks in pieces:
            base, n = slot * slot_blocks, int(src_blocks.size)
            rows.append(np.stack([src_blocks, np.arange(base, base + n)], axis=1))
            descs.append((self._buffer.data_ptr() + base * bb, self.grant.address + base * bb, n * bb))
        mapping = torch.from_numpy(np.concatenate(rows))
        copy = lambda: ops.swap_blocks_batch([self._caches[layer]], [self._buffer], mapping)  # noqa: E731
        if self._stream is None:
            return _Gather(copy, descs)
        return _DeviceCopy(self._stream, copy, descs, self._copy_timeout_s)

    def close(self) -> None:
        _drain(self._stream)
        self._transport.unregister(self._buffer.data_ptr())


class _Gather:
    """One host copy running on its own thread (the op releases the GIL while copying)."""

    def __init__(self, run, value) -> None:
        self._value = value
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(run,), name="kvops-gather", daemon=True)
        self._thread.start()

    def _run(self, run) -> None:
        try:
            run()
        except BaseException as exc:  # handed to the sender by result()
            self._error = exc

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
