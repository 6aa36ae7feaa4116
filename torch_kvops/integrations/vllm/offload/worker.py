"""``KvopsOffloadingWorker``: vLLM's ``OffloadingWorker`` over a
:class:`~torch_kvops.offload.HostTierMover`.

What a failure means. vLLM 0.32's ``OffloadingConnector`` asserts that every submit
returns True and every ``TransferResult`` has ``success=True``: it has no path for a
failed job. Reporting a failed store as done would make the manager serve chunks that
were never written (wrong tokens, silently); a failed load would run the forward on
blocks that were never filled. So the worker never reports a job it could not
complete: a job it refuses (an index out of range, counts that do not add up; checked
before any byte moves) or a copy that raises stops the engine with an
``OffloadJobError`` naming the job, instead of a bare assertion later.
"""
from __future__ import annotations

from typing import List, Set

from vllm.v1.kv_offload.base import (BlockIDsLoadStoreSpec, GPULoadStoreSpec, LoadStoreSpec,
                                     OffloadingWorker, TransferResult)

from ....offload import HostTier, HostTierMover, OffloadJobError


class KvopsOffloadingWorker(OffloadingWorker):
    """Moves blocks between vLLM's KV caches and a host tier (CPU, CUDA, NPU)."""

    def __init__(self, tier: HostTier):
        self.mover = HostTierMover(tier)
        # jobs submitted to this rank (with one shared host copy, rank 0 alone stores)
        self.jobs_submitted = {"store": 0, "load": 0}

    @property
    def tier(self) -> HostTier:
        return self.mover.tier

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Engine blocks ``src_spec`` -> host chunks ``dst_spec`` (asynchronous on devices)."""
        _check_specs("store", job_id, src_spec, dst_spec)
        self.mover.store(job_id, src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices,
                         dst_spec.block_ids)
        self.jobs_submitted["store"] += 1
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        """Host chunks ``src_spec`` -> engine blocks ``dst_spec`` (asynchronous on devices).
        ``expedited`` (vLLM 0.33: a load the next forward waits for) changes nothing
        here: loads are already issued at once, in submission order."""
        _check_specs("load", job_id, dst_spec, src_spec)
        self.mover.load(job_id, dst_spec.block_ids, dst_spec.group_sizes, dst_spec.block_indices,
                        src_spec.block_ids)
        self.jobs_submitted["load"] += 1
        return True

    def get_finished(self) -> List[TransferResult]:
        # bytes and seconds both set: vLLM's offload metrics count only such results
        return [TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=seconds)
                for job_id, nbytes, seconds in self.mover.finished()]

    def wait(self, job_ids: Set[int]) -> None:
        """Returns once the named jobs' copies (source reads included) are done."""
        self.mover.wait(job_ids)

    def shutdown(self) -> None:
        """Drains queued copies, then drops the host tier."""
        self.mover.close()


def _check_specs(kind: str, job_id: int, engine_spec: LoadStoreSpec, host_spec: LoadStoreSpec) -> None:
    if not isinstance(engine_spec, GPULoadStoreSpec) or not isinstance(host_spec, BlockIDsLoadStoreSpec):
        raise OffloadJobError(
            f"KvopsOffloadingSpec: {kind} job {job_id}: expected engine blocks (GPULoadStoreSpec) "
            f"and host chunks (CPULoadStoreSpec), got {type(engine_spec).__name__} and "
            f"{type(host_spec).__name__}")
