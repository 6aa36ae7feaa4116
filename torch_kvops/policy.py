"""Copy policy of the CUDA backend of ``swap_blocks_batch``: which engine copies each
descriptor (copy kernel or DMA) and how many thread blocks the kernel may use.

Defaults come from the environment at the first copy (``KVOPS_CUDA_COPY=auto|kernel|dma``,
``KVOPS_CUDA_COPY_MAX_CTAS``, ``KVOPS_CUDA_DMA_MIN_BYTES``, ``KVOPS_CUDA_DMA_MIN_BYTES_D2D``);
:func:`set_copy_policy` overrides them for the process. CPU and NPU copies ignore it.
See docs/ops.md for the thresholds and why.
"""
from __future__ import annotations

from typing import Dict, Optional, Union

from ._C import _get_copy_policy, _set_copy_policy

__all__ = ["get_copy_policy", "set_copy_policy"]


def get_copy_policy() -> Dict[str, Union[str, int]]:
    """The current policy: ``{"mode", "max_ctas", "dma_min_bytes", "dma_min_bytes_d2d"}``.

    Raises ``RuntimeError`` if the environment holds a bad value and no policy was set."""
    return dict(_get_copy_policy())


def set_copy_policy(mode: Optional[str] = None, *, max_ctas: Optional[int] = None,
                    dma_min_bytes: Optional[int] = None,
                    dma_min_bytes_d2d: Optional[int] = None) -> Dict[str, Union[str, int]]:
    """Change the CUDA copy policy for the whole process; returns the previous policy
    (pass it back as ``set_copy_policy(**old)`` to restore).

    - ``mode``: ``"auto"`` (default: kernel for descriptors below the DMA threshold, DMA
      above), ``"kernel"`` (kernel wherever both sides are kernel-addressable) or
      ``"dma"`` (the copy engines only: cuMemcpyBatchAsync, or one cudaMemcpyAsync per
      descriptor on the legacy default stream and under graph capture). Pageable host
      memory and another GPU's memory always go to DMA.
    - ``max_ctas``: upper bound on the copy kernel's grid (blocks of 256 threads;
      default 128).
    - ``dma_min_bytes`` / ``dma_min_bytes_d2d``: in auto mode, merged descriptors of at
      least this many bytes use DMA; host<->device default 256 KiB, device<->device
      default 16 MiB.

    Fields left ``None`` keep their value. Invalid values raise ``RuntimeError`` and
    change nothing."""
    old = get_copy_policy()
    _set_copy_policy(mode, max_ctas, dma_min_bytes, dma_min_bytes_d2d)
    return old
