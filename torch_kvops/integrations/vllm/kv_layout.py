"""The KV cache layout the connector asks vLLM for, and each layer's cache in the
physical axis order it moves.

vLLM (0.32) describes a layer's attention cache as logical ``[num_blocks, kv_heads,
block_size, content]`` laid out in one of several physical orders (``KVCacheLayout``,
RFC #42082), resolved once per engine from what its attention backends support, the
connector's requirement and ``$VLLM_KV_CACHE_LAYOUT``; it reaches the workers on
``cache_config.kv_cache_layout``. The connector requires :data:`HEAD_MAJOR` (LBHNC:
each layer's blocks outermost, then heads), as vLLM's NIXL connector does: one KV head
of one block is contiguous there, so unequal tensor parallelism moves head ranges
(tp.py) and equal TP whole blocks, with the same descriptors. Every backend that
supports it uses it (CPU, FlashAttention, FlashInfer...); where one cannot, vLLM warns
and picks another: whole blocks then move between equal TP sizes, in the layout's
physical order, and unequal TP is refused. The layout is taken from vLLM, never
guessed from a shape, and each side tells its peer which one it has: two engines with
different layouts never exchange bytes (their blocks would be read in another order).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["HEAD_MAJOR", "in_physical_order", "layer_view_order"]

HEAD_MAJOR = "LBHNC"


def layer_view_order(layout: str):
    """The physical axis order of a layer's logical 4-D cache under ``layout``
    (vLLM's ``KVCacheLayout.layer_view_order``; its legacy names are accepted)."""
    from vllm.config.cache import _layout_from_name  # the one place vLLM parses names

    return _layout_from_name(layout).layer_view_order


def in_physical_order(name: str, cache: torch.Tensor, layout: Optional[str]) -> torch.Tensor:
    """``cache`` (logical ``[num_blocks, kv_heads, block_size, content]``) permuted into
    ``layout``'s physical order, checked to be laid out that way; unchanged without a
    layout (an engine that resolved none) or for a cache that is not 4-D (MLA)."""
    if layout is None or cache.dim() != 4:
        return cache
    order = layer_view_order(layout)
    if order[0] != 0:  # vLLM's orders are permutations: only where the blocks go matters
        raise ValueError(f"KV cache {name!r}: vLLM's layout {layout} does not keep each layer's "
                         f"blocks outermost; KvopsLayerwiseConnector needs {HEAD_MAJOR} (it asks "
                         "vLLM for it) or another block-outermost layout")
    physical = cache.permute(*order)
    if not physical[0].is_contiguous():
        raise ValueError(f"KV cache {name!r}: shape={tuple(cache.shape)} stride={cache.stride()} is "
                         f"not laid out as vLLM's layout {layout} says (order {order})")
    return physical
