"""Store and load jobs between an engine's KV tensors and its :class:`HostTier`: one
``swap_blocks_batch.ptrs`` call per job (the op merges adjacent ranges into one copy)."""
from __future__ import annotations

from typing import List, Sequence, Set

from .copiers import Finished, HostCopier, StreamCopier
from .descriptors import CopyDescriptors, DescriptorBuilder
from .tier import STREAM_DEVICES, HostTier


class OffloadJobError(RuntimeError):
    """A store or load job that was refused (before any byte moved) or whose copy failed."""


class HostTierMover:
    """Moves blocks both ways between the engine's KV tensors and ``tier``.

    On the CPU a job's copy is done when ``store``/``load`` returns; on CUDA and NPU it
    is queued on one stream per direction (so a load does not wait behind a long
    store), ordered after the work already on the compute stream. A job is never
    reported finished unless its copy completed: a refused job or a failed copy raises
    :class:`OffloadJobError` naming the job.
    """

    def __init__(self, tier: HostTier):
        self.tier = tier
        self._builder = DescriptorBuilder(tier.layout)
        if tier.device.type in STREAM_DEVICES:
            self._copiers = {"store": StreamCopier(tier.device), "load": StreamCopier(tier.device)}
        else:
            host = HostCopier()
            self._copiers = {"store": host, "load": host}

    def store(self, job_id: int, engine_blocks: Sequence[int], group_sizes: Sequence[int],
              block_indices: Sequence[int], chunks: Sequence[int]) -> None:
        """Engine blocks (ordered by cache group, ``group_sizes[g]`` of group ``g``, whose
        first block is the request's logical block ``block_indices[g]``) -> host ``chunks``."""
        self._submit("store", job_id, engine_blocks, group_sizes, block_indices, chunks)

    def load(self, job_id: int, engine_blocks: Sequence[int], group_sizes: Sequence[int],
             block_indices: Sequence[int], chunks: Sequence[int]) -> None:
        """Host ``chunks`` -> engine blocks (arguments as :meth:`store`)."""
        self._submit("load", job_id, engine_blocks, group_sizes, block_indices, chunks)

    def descriptors(self, engine_blocks: Sequence[int], group_sizes: Sequence[int],
                    block_indices: Sequence[int], chunks: Sequence[int], to_host: bool) -> CopyDescriptors:
        """The copies a job makes (arguments as :meth:`store`); raises ValueError if the
        job is inconsistent with the tier."""
        return self._builder.build(engine_blocks, group_sizes, block_indices, chunks, to_host)

    def finished(self) -> List[Finished]:
        """(job id, bytes, seconds) of the jobs completed since the last call."""
        return [done for copier in self._distinct_copiers() for done in copier.finished()]

    def wait(self, job_ids: Set[int]) -> None:
        """Returns once the named jobs' copies, source reads included, are done."""
        for copier in self._distinct_copiers():
            copier.wait(job_ids)

    def close(self) -> None:
        """Waits for queued copies, then drops the host tier."""
        try:
            for copier in self._distinct_copiers():
                copier.close()
        finally:
            self.tier.release()

    def _distinct_copiers(self):
        store, load = self._copiers["store"], self._copiers["load"]
        return [store] if store is load else [store, load]

    def _submit(self, kind: str, job_id: int, engine_blocks, group_sizes, block_indices, chunks) -> None:
        try:
            descs = self.descriptors(engine_blocks, group_sizes, block_indices, chunks,
                                     to_host=kind == "store")
        except ValueError as e:
            raise OffloadJobError(f"KV offloading: {kind} job {job_id} refused, no byte moved: {e}") from e
        self._copy(kind, job_id, descs)

    def _copy(self, kind: str, job_id: int, descs: CopyDescriptors) -> None:
        try:
            self._copiers[kind].submit(job_id, descs)
        except RuntimeError as e:
            raise OffloadJobError(f"KV offloading: {kind} job {job_id} ({len(descs)} copies, "
                                  f"{descs.num_bytes} bytes) failed: {e}") from e
