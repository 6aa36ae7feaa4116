"""Copy descriptors for one offloading job: pure address arithmetic, no vLLM, no copies.

The host tier keeps, per engine KV tensor, one row per *chunk* of ``blocks_per_chunk``
engine blocks; engine block ``j`` of a chunk sits at ``j * page_bytes`` in the row
(``page_bytes`` is the engine's possibly padded page, as in vLLM's
``cpu/gpu_worker.py``). A job names engine blocks per cache group, the chunks, and per
group the request-logical index of its first engine block: a job may start inside a
chunk, so the first ``block_index % blocks_per_chunk`` slots of its first chunk are
skipped (the same skip/count arithmetic as vLLM's ``SingleDirectionOffloadingHandler``).

Every index is checked against the tensors before an address is formed, so the
addresses handed to ``swap_blocks_batch.ptrs`` are valid by construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np
import torch


@dataclass(frozen=True)
class TierRegion:
    """One engine KV tensor (blocks along dim 0) and its rows in the host tier."""

    engine_base: int
    engine_block_stride: int  # bytes from one engine block to the next
    num_engine_blocks: int
    host_base: int
    host_chunk_stride: int  # bytes from one host row (chunk) to the next
    num_host_chunks: int
    page_bytes: int  # engine page incl. padding: where block j of a chunk starts in its row


@dataclass(frozen=True)
class GroupRef:
    """A layer of a cache group: which region holds it, and how many bytes of each of
    its pages to copy (vLLM's unpadded ``page_size_bytes``)."""

    region: int
    copy_bytes: int


@dataclass(frozen=True)
class TierLayout:
    regions: Tuple[TierRegion, ...]
    groups: Tuple[Tuple[GroupRef, ...], ...]
    blocks_per_chunk: int


@dataclass(frozen=True)
class CopyDescriptors:
    """Arguments of one ``swap_blocks_batch.ptrs`` call (1-D int64 CPU tensors) and the
    bytes they move (before the op merges adjacent ranges)."""

    src: torch.Tensor
    dst: torch.Tensor
    sizes: torch.Tensor
    num_bytes: int

    def __len__(self) -> int:
        return int(self.sizes.numel())


class _GroupArrays:
    """A group's per-layer constants as column vectors, so one broadcast forms the
    addresses of every (layer, block) pair of the group."""

    def __init__(self, layout: TierLayout, refs: Sequence[GroupRef]):
        regions = [layout.regions[r.region] for r in refs]

        def column(values):
            return np.asarray(values, dtype=np.int64).reshape(-1, 1)

        self.layers = len(refs)
        self.engine_base = column([g.engine_base for g in regions])
        self.engine_stride = column([g.engine_block_stride for g in regions])
        self.host_base = column([g.host_base for g in regions])
        self.host_stride = column([g.host_chunk_stride for g in regions])
        self.page = column([g.page_bytes for g in regions])
        self.copy_bytes = column([r.copy_bytes for r in refs])
        self.bytes_per_block = sum(r.copy_bytes for r in refs)
        self.engine_blocks = min((g.num_engine_blocks for g in regions), default=0)
        self.host_chunks = min((g.num_host_chunks for g in regions), default=0)


class DescriptorBuilder:
    """Builds the descriptors of store (engine -> host) and load (host -> engine) jobs
    for one :class:`TierLayout`. Descriptors come layer by layer, blocks in job order
    within a layer, so a run of adjacent blocks on both sides is merged by the op."""

    def __init__(self, layout: TierLayout):
        if layout.blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {layout.blocks_per_chunk}")
        self.layout = layout
        self._groups = [_GroupArrays(layout, refs) for refs in layout.groups]

    def build(self, engine_blocks: Sequence[int], group_sizes: Sequence[int],
              block_indices: Sequence[int], chunks: Sequence[int], to_host: bool) -> CopyDescriptors:
        """Descriptors for one job. ``engine_blocks`` are ordered by group
        (``group_sizes[g]`` of them for group ``g``), ``block_indices[g]`` is the
        request-logical index of group ``g``'s first block, ``chunks`` are host rows,
        ordered by group too. Raises ValueError (nothing built) on any inconsistency."""
        engine_blocks = np.asarray(engine_blocks, dtype=np.int64).reshape(-1)
        chunks = np.asarray(chunks, dtype=np.int64).reshape(-1)
        plan = self._plan(engine_blocks, [int(n) for n in group_sizes],
                          [int(i) for i in block_indices], len(chunks))
        total = sum(self._groups[g].layers * n for g, n, _, _, _ in plan)
        engine_addr = np.empty(total, dtype=np.int64)
        host_addr = np.empty(total, dtype=np.int64)
        sizes = np.empty(total, dtype=np.int64)
        bpc = self.layout.blocks_per_chunk
        num_bytes = out = 0
        for g, n, skip, e_off, c_off in plan:
            arrays = self._groups[g]
            blocks = engine_blocks[e_off:e_off + n]
            rows = chunks[c_off:c_off + -(-(n + skip) // bpc)]
            _check_range(blocks, arrays.engine_blocks, f"group {g}: engine block")
            _check_range(rows, arrays.host_chunks, f"group {g}: host chunk")
            end = out + arrays.layers * n
            # (layers, n) views of this group's share of the outputs
            e_view = engine_addr[out:end].reshape(arrays.layers, n)
            h_view = host_addr[out:end].reshape(arrays.layers, n)
            np.multiply(blocks, arrays.engine_stride, out=e_view)
            e_view += arrays.engine_base
            if bpc == 1:
                np.multiply(rows, arrays.host_stride, out=h_view)
            else:
                # engine block k of the group goes to slot (skip + k) of the group's chunks
                position = skip + np.arange(n, dtype=np.int64)
                np.multiply(rows[position // bpc], arrays.host_stride, out=h_view)
                h_view += (position % bpc) * arrays.page
            h_view += arrays.host_base
            sizes[out:end].reshape(arrays.layers, n)[:] = arrays.copy_bytes
            num_bytes += arrays.bytes_per_block * n
            out = end
        engine_t, host_t = torch.from_numpy(engine_addr), torch.from_numpy(host_addr)
        src, dst = (engine_t, host_t) if to_host else (host_t, engine_t)
        return CopyDescriptors(src, dst, torch.from_numpy(sizes), num_bytes)

    def _plan(self, engine_blocks: np.ndarray, sizes: list, starts: list, num_chunks: int):
        """(group, blocks, skipped slots, first engine block, first chunk) of every
        non-empty group, once the job's counts are known to add up."""
        if len(sizes) != len(self._groups) or len(starts) != len(self._groups):
            raise ValueError(f"job names {len(sizes)} group sizes and {len(starts)} block indices "
                             f"for {len(self._groups)} offloaded cache groups")
        if min(sizes, default=0) < 0 or min(starts, default=0) < 0:
            raise ValueError(f"negative group size or block index: {sizes}, {starts}")
        if sum(sizes) != len(engine_blocks):
            raise ValueError(f"group sizes {sizes} add up to {sum(sizes)}, "
                             f"but the job names {len(engine_blocks)} engine blocks")
        bpc = self.layout.blocks_per_chunk
        plan, e_off, c_off = [], 0, 0
        for g, (n, start) in enumerate(zip(sizes, starts)):
            if n == 0:
                continue
            skip = start % bpc
            spans = -(-(n + skip) // bpc)
            if c_off + spans > num_chunks:
                raise ValueError(f"group {g}: {n} blocks starting at logical block {start} span "
                                 f"{spans} chunks of {bpc}, but only {num_chunks - c_off} chunks are left")
            plan.append((g, n, skip, e_off, c_off))
            e_off += n
            c_off += spans
        if c_off != num_chunks:
            raise ValueError(f"the job names {num_chunks} chunks but its blocks fill {c_off}")
        return plan


def _check_range(ids: np.ndarray, limit: int, what: str) -> None:
    # one comparison: negative ids become huge when read as unsigned
    if (ids.view(np.uint64) >= limit).any():
        bad = ids[(ids < 0) | (ids >= limit)][0]
        raise ValueError(f"{what} {int(bad)} out of range [0, {limit})")
