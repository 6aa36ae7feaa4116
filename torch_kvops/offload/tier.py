"""The host tier: checks that the engine's KV tensors can be addressed block by block,
allocates one host tensor per engine tensor (``num_chunks`` rows of
``blocks_per_chunk`` pages) and describes both as a :class:`TierLayout`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from .descriptors import GroupRef, TierLayout, TierRegion

# Device types whose copies go through a stream owned by the mover (the rest: the CPU).
STREAM_DEVICES = ("cuda", "npu")

LAYOUT_HINT = ("; KV offloading needs blocks along dim 0, each one contiguous page "
               "(in vLLM: kv_cache_layout LBHNC, which OffloadingConnector requests)")


class OffloadConfigError(ValueError):
    """A setting or engine layout KV offloading cannot serve (raised at start-up)."""


@dataclass
class HostTier:
    """Engine KV tensors, their host-tier twins, and the layout that addresses both."""

    device: torch.device
    engine: List[torch.Tensor]  # (num_blocks, page) views of the engine's caches, kept alive
    host: List[torch.Tensor]
    layout: TierLayout
    # called once the tensors are dropped (e.g. unmapping a shared host region)
    on_release: List[Callable[[], None]] = field(default_factory=list)

    def release(self) -> None:
        self.engine.clear()
        self.host.clear()
        hooks, self.on_release = self.on_release, []
        for hook in hooks:
            hook()


def build_host_tier(tensors: Sequence[torch.Tensor], page_sizes: Sequence[int],
                    groups: Sequence[Sequence[GroupRef]], num_chunks: int,
                    blocks_per_chunk: int,
                    host_rows: Optional[Callable[[int], torch.Tensor]] = None) -> HostTier:
    """``tensors[i]`` holds engine blocks along dim 0 in pages of ``page_sizes[i]`` bytes
    (padding included; vLLM's ``CanonicalKVCacheTensor``); ``groups[g]`` lists cache
    group ``g``'s layers. The host tier is pinned when the tensors are on a device.
    ``host_rows(row_bytes)``, if given, supplies each tensor's host rows (an int8
    ``(num_chunks, row_bytes)`` view, rows may be strided: e.g. a region shared by the
    ranks of one engine) instead of a private allocation (CPU tensors only).
    Everything is checked before it is allocated."""
    device = _check_device(tensors)
    if len(page_sizes) != len(tensors):
        raise OffloadConfigError(f"KV offloading: {len(page_sizes)} page sizes for {len(tensors)} KV tensors")
    for i, (t, page) in enumerate(zip(tensors, page_sizes)):
        _check_tensor(i, t, int(page))
    if blocks_per_chunk < 1 or num_chunks < 0:
        raise OffloadConfigError(f"KV offloading: blocks_per_chunk must be >= 1 and num_chunks >= 0, "
                                 f"got {blocks_per_chunk} and {num_chunks}")
    for g, refs in enumerate(groups):
        if not refs:
            raise OffloadConfigError(f"KV offloading: cache group {g} has no KV tensor to offload")
        for ref in refs:
            if not 0 <= ref.region < len(tensors):
                raise OffloadConfigError(f"KV offloading: cache group {g} names KV tensor "
                                         f"{ref.region} of {len(tensors)}")
            page = int(page_sizes[ref.region])
            if not 0 < ref.copy_bytes <= page:
                raise OffloadConfigError(
                    f"KV offloading: cache group {g}: a layer's page of {ref.copy_bytes} bytes "
                    f"does not fit the {page}-byte pages of KV tensor {ref.region}")

    pinned = device.type in STREAM_DEVICES  # device copies from pageable memory are synchronous
    if host_rows is not None and pinned:
        raise OffloadConfigError("KV offloading: a shared host tier is supported for CPU KV caches only")
    host, regions = [], []
    for t, page in zip(tensors, page_sizes):
        row_bytes = int(page) * blocks_per_chunk
        if host_rows is not None:
            h = host_rows(row_bytes)
            if (h.dtype != torch.int8 or tuple(h.shape) != (num_chunks, row_bytes) or h.stride(1) != 1
                    or h.device.type != "cpu"):
                raise OffloadConfigError(f"KV offloading: host rows {tuple(h.shape)} {h.dtype} stride "
                                         f"{h.stride()} on {h.device}, expected int8 ({num_chunks}, "
                                         f"{row_bytes}) with contiguous rows on the CPU")
        else:
            # torch.empty: a row is read only after a store wrote it, and on the CPU the
            # tier's pages are committed as it fills instead of all at start-up.
            h = torch.empty((num_chunks, row_bytes), dtype=torch.int8, pin_memory=pinned)
        host.append(h)
        regions.append(TierRegion(
            engine_base=t.data_ptr(), engine_block_stride=t.stride(0) * t.element_size(),
            num_engine_blocks=t.shape[0], host_base=h.data_ptr(), host_chunk_stride=h.stride(0),
            num_host_chunks=num_chunks, page_bytes=int(page)))
    layout = TierLayout(tuple(regions), tuple(tuple(refs) for refs in groups), blocks_per_chunk)
    return HostTier(device, list(tensors), host, layout)


def _check_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    if not tensors:
        raise OffloadConfigError("KV offloading: no KV tensors to offload")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise OffloadConfigError(f"KV offloading: KV tensors on several devices {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cpu",) + STREAM_DEVICES:
        raise OffloadConfigError(f"KV offloading: KV caches on {device.type} are not supported "
                                 "(cpu, cuda and npu are)")
    if device.type in STREAM_DEVICES:
        from .._C import build_info

        if not build_info()[device.type]:
            raise OffloadConfigError(
                f"KV offloading: the KV caches are on {device.type}, but this build of torch_kvops "
                f"has no {device.type} backend (torch_kvops.build_info() = {build_info()}); "
                "rebuild the extension where the toolkit is installed")
    return device


def _check_tensor(i: int, t: torch.Tensor, page: int) -> None:
    where = f"KV offloading: KV tensor {i} (shape {tuple(t.shape)}, stride {t.stride()})"
    if t.dim() < 1 or t.shape[0] < 1:
        raise OffloadConfigError(where + " has no blocks" + LAYOUT_HINT)
    if not t[0].is_contiguous():
        raise OffloadConfigError(where + ": a block is not contiguous" + LAYOUT_HINT)
    block_bytes = t[0].numel() * t.element_size()
    if page <= 0 or page > block_bytes:
        raise OffloadConfigError(f"{where}: page_size_bytes {page} does not fit a block of "
                                 f"{block_bytes} bytes" + LAYOUT_HINT)
    if t.shape[0] > 1 and t.stride(0) * t.element_size() < block_bytes:
        raise OffloadConfigError(where + ": blocks overlap" + LAYOUT_HINT)
