"""The host tier: checks that the engine's KV tensors can be addressed block by block,
allocates one host tensor per engine tensor (``num_chunks`` rows of
``blocks_per_chunk`` pages) and describes both as a :class:`TierLayout`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from .descriptors import GroupRef, TierLayout, TierRegion

# Device types whose copies go through a connector-owned stream (the rest: the CPU).
STREAM_DEVICES = ("cuda", "npu")


class OffloadConfigError(ValueError):
    """A setting or engine layout the offloading worker cannot serve (raised at start-up)."""


@dataclass
class HostTier:
    device: torch.device
    engine: List[torch.Tensor]  # vLLM's canonical (num_blocks, page) views, kept alive
    host: List[torch.Tensor]
    layout: TierLayout

    def release(self) -> None:
        self.engine.clear()
        self.host.clear()


def build_host_tier(tensors: Sequence[torch.Tensor], page_sizes: Sequence[int],
                    group_refs: Sequence[Sequence[object]], num_groups: int,
                    num_chunks: int, blocks_per_chunk: int) -> HostTier:
    """``tensors[i]`` holds blocks along dim 0 with pages of ``page_sizes[i]`` bytes
    (vLLM's ``CanonicalKVCacheTensor``); ``group_refs[g]`` lists the group's
    ``CanonicalKVCacheRef`` (``tensor_idx``, unpadded ``page_size_bytes``; its canonical
    ``mapping`` is not used: the spec refuses ``canonical_layout``).
    Everything is checked before the host tier is allocated."""
    device = _check_device(tensors)
    if len(group_refs) != num_groups:
        raise OffloadConfigError(
            f"KvopsOffloadingSpec: the worker got KV tensors for {len(group_refs)} cache groups, "
            f"the offloading config names {num_groups}")
    for i, (t, page) in enumerate(zip(tensors, page_sizes)):
        _check_tensor(i, t, int(page))
    groups = []
    for g, refs in enumerate(group_refs):
        if not refs:
            raise OffloadConfigError(f"KvopsOffloadingSpec: cache group {g} has no KV tensor to offload")
        group = []
        for ref in refs:
            if not 0 <= ref.tensor_idx < len(tensors):
                raise OffloadConfigError(f"KvopsOffloadingSpec: cache group {g} names KV tensor "
                                         f"{ref.tensor_idx} of {len(tensors)}")
            page = int(page_sizes[ref.tensor_idx])
            if not 0 < ref.page_size_bytes <= page:
                raise OffloadConfigError(
                    f"KvopsOffloadingSpec: cache group {g}: a layer's page of {ref.page_size_bytes} "
                    f"bytes does not fit the {page}-byte pages of KV tensor {ref.tensor_idx}")
            group.append(GroupRef(region=ref.tensor_idx, copy_bytes=int(ref.page_size_bytes)))
        groups.append(tuple(group))

    pinned = device.type in STREAM_DEVICES  # device copies from pageable memory are synchronous
    host, regions = [], []
    for t, page in zip(tensors, page_sizes):
        # torch.empty: rows are read only after a store wrote them, and on the CPU the
        # pages are committed as the tier fills instead of all at start-up.
        h = torch.empty((num_chunks, int(page) * blocks_per_chunk), dtype=torch.int8,
                        pin_memory=pinned)
        host.append(h)
        regions.append(TierRegion(
            engine_base=t.data_ptr(), engine_block_stride=t.stride(0) * t.element_size(),
            num_engine_blocks=t.shape[0], host_base=h.data_ptr(), host_chunk_stride=h.stride(0),
            num_host_chunks=num_chunks, page_bytes=int(page)))
    layout = TierLayout(tuple(regions), tuple(groups), blocks_per_chunk)
    return HostTier(device, list(tensors), host, layout)


def _check_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    if not tensors:
        raise OffloadConfigError("KvopsOffloadingSpec: vLLM handed the worker no KV tensors")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise OffloadConfigError(f"KvopsOffloadingSpec: KV tensors on several devices {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cpu",) + STREAM_DEVICES:
        raise OffloadConfigError(f"KvopsOffloadingSpec: KV caches on {device.type} are not supported "
                                 "(cpu, cuda and npu are)")
    if device.type in STREAM_DEVICES:
        from .... import build_info

        if not build_info()[device.type]:
            raise OffloadConfigError(
                f"KvopsOffloadingSpec: the KV caches are on {device.type}, but this build of "
                f"torch_kvops has no {device.type} backend (torch_kvops.build_info() = {build_info()}); "
                "rebuild the extension where the toolkit is installed")
    return device


def _check_tensor(i: int, t: torch.Tensor, page: int) -> None:
    where = f"KvopsOffloadingSpec: KV tensor {i} (shape {tuple(t.shape)}, stride {t.stride()})"
    layout_hint = ("; the worker needs blocks along dim 0, each one contiguous page "
                   "(vLLM's kv_cache_layout LBHNC, which OffloadingConnector requests)")
    if t.dim() < 1 or t.shape[0] < 1:
        raise OffloadConfigError(where + " has no blocks" + layout_hint)
    if not t[0].is_contiguous():
        raise OffloadConfigError(where + ": a block is not contiguous" + layout_hint)
    block_bytes = t[0].numel() * t.element_size()
    if page <= 0 or page > block_bytes:
        raise OffloadConfigError(f"{where}: page_size_bytes {page} does not fit a block of "
                                 f"{block_bytes} bytes" + layout_hint)
    if t.shape[0] > 1 and t.stride(0) * t.element_size() < block_bytes:
        raise OffloadConfigError(where + ": blocks overlap" + layout_hint)
