"""TEST-ONLY stand-in for the two CPU kernels of ``sgl_kernel`` that SGLang 0.5.23
imports on CPU and that have no wheel on PyPI (they live in sglang-kernel-cpu, C++
sources only). Plain torch, same arguments and effect; everything else SGLang runs is
its own code. Put this folder on an SGLang server's PYTHONPATH; never install it."""
import ctypes

import torch

STANDIN = True  # what tests check to know this module, not a real sgl_kernel, is loaded


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, max_len: int) -> None:
    """req_to_token[req, start:end] = the next (end - start) entries of out_cache_loc,
    request after request."""
    taken = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(),
                                end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every buffer (base address, bytes per token slot): copy slot src_loc[i] to
    slot tgt_loc[i]."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for tgt, src in zip(tgt_loc.tolist(), src_loc.tolist()):
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def __getattr__(name: str):
    """Any other kernel SGLang imports on CPU (speculative decoding, MoE, quantization...):
    importable, and loud if a run ever calls it."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in the test stand-in "
                                  "(tests/sglang_standin)")
    missing.__name__ = name
    return missing
