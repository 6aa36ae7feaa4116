"""``KvopsOffloadingWorker``: vLLM's ``OffloadingWorker`` on top of
``torch.ops.kvops.swap_blocks_batch.ptrs`` (one call per job; the op merges adjacent
ranges into one copy).

What a failure means. vLLM 0.32's ``OffloadingConnector`` asserts that every submit
returns True and every ``TransferResult`` has ``success=True``: it has no path for a
failed job. Reporting a failed store as done would make the manager serve chunks that
were never written (wrong tokens, silently); a failed load would run the forward on
blocks that were never filled. So the worker never reports a job it could not complete:
a job it refuses (an index out of range, counts that do not add up; checked before any
byte moves) or a copy that raises stops the engine with an :class:`OffloadJobError`
naming the job, instead of a bare assertion later.
"""
from __future__ import annotations

from typing import List, Set

from vllm.v1.kv_offload.base import (BlockIDsLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec,
                                     OffloadingWorker, TransferResult)

from .copiers import HostCopier, StreamCopier
from .descriptors import CopyDescriptors, DescriptorBuilder
from .tier import STREAM_DEVICES, HostTier


class OffloadJobError(RuntimeError):
    """A store or load job that could not be completed (the engine stops)."""


class KvopsOffloadingWorker(OffloadingWorker):
    """Moves blocks between the engine's KV caches and a :class:`HostTier`."""

    def __init__(self, tier: HostTier):
        self.tier = tier
        self._builder = DescriptorBuilder(tier.layout)
        if tier.device.type in STREAM_DEVICES:
            # one stream per direction: a load is not queued behind a long store
            self._stores = StreamCopier(tier.device)
            self._loads = StreamCopier(tier.device)
        else:
            self._stores = self._loads = HostCopier()

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Engine blocks ``src_spec`` -> host chunks ``dst_spec`` (asynchronous on devices)."""
        descs = self._descriptors("store", job_id, src_spec, dst_spec, to_host=True)
        self._run(self._stores, "store", job_id, descs)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        """Host chunks ``src_spec`` -> engine blocks ``dst_spec`` (asynchronous on devices)."""
        descs = self._descriptors("load", job_id, dst_spec, src_spec, to_host=False)
        self._run(self._loads, "load", job_id, descs)
        return True

    def get_finished(self) -> List[TransferResult]:
        copiers = [self._stores] if self._stores is self._loads else [self._stores, self._loads]
        return [TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=seconds)
                for copier in copiers for job_id, nbytes, seconds in copier.finished()]

    def wait(self, job_ids: Set[int]) -> None:
        """Returns once the named jobs' copies (source reads included) are done."""
        self._stores.wait(job_ids)
        if self._loads is not self._stores:
            self._loads.wait(job_ids)

    def shutdown(self) -> None:
        """Drains queued copies, then drops the host tier."""
        try:
            self._stores.close()
            if self._loads is not self._stores:
                self._loads.close()
        finally:
            self.tier.release()

    def _descriptors(self, kind: str, job_id: int, engine_spec: LoadStoreSpec,
                     host_spec: LoadStoreSpec, to_host: bool) -> CopyDescriptors:
        if not isinstance(engine_spec, GPULoadStoreSpec) or not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise OffloadJobError(
                f"KvopsOffloadingSpec: {kind} job {job_id}: expected engine blocks (GPULoadStoreSpec) "
                f"and host chunks (CPULoadStoreSpec), got {type(engine_spec).__name__} and "
                f"{type(host_spec).__name__}")
        try:
            return self._builder.build(engine_spec.block_ids, engine_spec.group_sizes,
                                       engine_spec.block_indices, host_spec.block_ids, to_host)
        except ValueError as e:
            raise OffloadJobError(f"KvopsOffloadingSpec: {kind} job {job_id} refused, "
                                  f"no byte moved: {e}") from e

    @staticmethod
    def _run(copier, kind: str, job_id: int, descs: CopyDescriptors) -> None:
        try:
            copier.submit(job_id, descs)
        except RuntimeError as e:
            raise OffloadJobError(f"KvopsOffloadingSpec: {kind} job {job_id} "
                                  f"({len(descs)} copies, {descs.num_bytes} bytes) failed: {e}") from e
