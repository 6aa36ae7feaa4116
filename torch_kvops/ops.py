"""Typed wrappers, docstrings and fake kernels for the ``kvops`` ops.

The schemas live in ``csrc/torch_bindings.cpp``; this module is named there with
``set_python_module`` so the fake kernels below are found when an op is traced.
Users may call either ``torch.ops.kvops.<op>`` or the wrappers here.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["swap_blocks_batch", "swap_blocks_batch_ptrs", "record_layer_event", "push_layer",
           "block_digests"]


def swap_blocks_batch(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                      block_mapping: torch.Tensor) -> None:
    """Copy KV blocks for every layer in one batched submission.

    For every layer ``i`` and row ``(s, d)`` of ``block_mapping`` (int64, shape
    ``[N, 2]``, on the CPU), block ``s`` of ``src[i]`` is copied into block ``d`` of
    ``dst[i]``; a block is index ``k`` along dim 0. Runs of consecutive blocks are
    merged into one descriptor. Device pairs: CPU->CPU, CUDA<->CUDA, CUDA<->CPU (pin
    the host side for asynchronous copies), NPU<->CPU, NPU<->NPU. Device copies are
    ordered on the current stream (source read in stream order). On CUDA, small
    descriptors are copied by a copy kernel and large merged runs, pageable host memory
    and other GPUs' memory by DMA (:func:`torch_kvops.set_copy_policy`,
    ``KVOPS_CUDA_COPY``); the CPU copy runs on torch's intra-op threads.

    Everything is validated before any byte moves (list lengths, mapping dtype and
    shape, indices in range, a destination named twice, dtype / bytes-per-block
    mismatch, unsupported or mixed devices, non-contiguous blocks); a rejected call
    raises ``RuntimeError`` naming the argument and leaves ``dst`` untouched. An empty
    mapping is a no-op.
    """
    torch.ops.kvops.swap_blocks_batch(list(src), list(dst), block_mapping)


def swap_blocks_batch_ptrs(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor,
                           sizes: torch.Tensor) -> None:
    """Raw-address form of :func:`swap_blocks_batch` (``kvops::swap_blocks_batch.ptrs``).

    ``src_ptrs``, ``dst_ptrs`` and ``sizes`` are 1-D int64 CPU tensors of equal length:
    copy ``sizes[k]`` bytes from address ``src_ptrs[k]`` to ``dst_ptrs[k]``. The shapes,
    dtypes and sizes are checked; the addresses cannot be: passing an address that is
    not valid memory of the right size is undefined behaviour, as with ``memcpy``.
    Device addresses are copied on the current CUDA/NPU stream; host addresses by a
    parallel memcpy. Adjacent ranges are merged. The op mutates nothing it can name,
    so it is registered as an ordered effectful op: torch.compile keeps it and keeps
    its order relative to other effectful ops.
    """
    torch.ops.kvops.swap_blocks_batch.ptrs(src_ptrs, dst_ptrs, sizes)


def record_layer_event(kv_cache: torch.Tensor, handle: int, layer: int) -> None:
    """Record ``layer``'s completion event of the :class:`~torch_kvops.LayerEvents`
    ``handle`` on the current stream of ``kv_cache``'s device.

    Call it right after the op that wrote the layer's KV cache: ``kv_cache`` is marked
    mutated, so compiled graphs keep the call and order it after that write. CUDA
    records a reusable event (an external record node while the stream is being
    captured, so the host can wait on it after every replay); the CPU needs no event.
    """
    torch.ops.kvops.record_layer_event(kv_cache, handle, layer)


def push_layer(kv_cache: torch.Tensor, handle: int, layer: int) -> None:
    """Tell the host that ``layer`` is ready to send once its event completes.

    Appends ``layer`` to the ready queue of LayerEvents ``handle`` (read with
    ``LayerEvents.next_ready``). Outside graph capture the append happens when the op
    runs; while a CUDA stream is capturing it becomes a host node that appends on
    every replay, in stream order.
    """
    torch.ops.kvops.push_layer(kv_cache, handle, layer)


def block_digests(cache: torch.Tensor, block_ids: torch.Tensor, seed: int,
                  parallel: bool = False) -> torch.Tensor:
    """A 16-byte checksum of each block of ``cache`` named in ``block_ids``.

    ``cache``: a CPU tensor, dim 0 = block, each block contiguous (blocks may lie apart).
    ``block_ids``: 1-D int64 CPU tensor. Returns uint8 ``[len(block_ids), 16]``: four
    CRC-32C (Castagnoli) values, little-endian, one per quarter of the block's bytes
    (the last quarter takes the remainder), each started from a value derived from
    ``seed`` and the quarter's index. Blocks are hashed on the calling thread, or
    with ``parallel`` on torch's intra-op threads; the GIL is released (SSE4.2
    ``crc32`` where the CPU has it, a table elsewhere: the same values). Not a MAC: anyone who knows the bytes can compute it (the
    connector's integrity_check="checksum"). Out-of-range ids raise ``RuntimeError``
    before anything is read.
    """
    return torch.ops.kvops.block_digests(cache, block_ids, seed, parallel)


def _attach_docs() -> None:
    packets = {
        "swap_blocks_batch": swap_blocks_batch,
        "record_layer_event": record_layer_event,
        "push_layer": push_layer,
        "block_digests": block_digests,
    }
    for name, fn in packets.items():
        getattr(torch.ops.kvops, name).__doc__ = fn.__doc__
        getattr(torch.ops.kvops, name).default.__doc__ = fn.__doc__
    torch.ops.kvops.swap_blocks_batch.ptrs.__doc__ = swap_blocks_batch_ptrs.__doc__


def _register_ordered_effect(qualname: str) -> None:
    """Mark an op that mutates nothing nameable as an ordered side effect, so
    torch.compile neither removes nor reorders it. The API is private and moved
    between releases (torch.library in 2.10+, torch._higher_order_ops.effects before)."""
    if hasattr(torch.library, "_register_effectful_op") and hasattr(torch.library, "EffectType"):
        torch.library._register_effectful_op(qualname, torch.library.EffectType.ORDERED)
        return
    from torch._higher_order_ops import effects

    overload_name = qualname.split("::")[1]
    packet, _, overload = overload_name.partition(".")
    op = getattr(getattr(torch.ops.kvops, packet), overload or "default")
    effects._register_effectful_op(op, effects._EffectType.ORDERED)


@torch.library.register_fake("kvops::swap_blocks_batch")
def _swap_blocks_batch_fake(src, dst, block_mapping):
    return None


@torch.library.register_fake("kvops::swap_blocks_batch.ptrs")
def _swap_blocks_batch_ptrs_fake(src_ptrs, dst_ptrs, sizes):
    return None


@torch.library.register_fake("kvops::record_layer_event")
def _record_layer_event_fake(kv_cache, handle, layer):
    return None


@torch.library.register_fake("kvops::push_layer")
def _push_layer_fake(kv_cache, handle, layer):
    return None


@torch.library.register_fake("kvops::block_digests")
def _block_digests_fake(cache, block_ids, seed, parallel=False):
    return block_ids.new_empty((block_ids.size(0), 16), dtype=torch.uint8)


_register_ordered_effect("kvops::swap_blocks_batch.ptrs")
_attach_docs()
