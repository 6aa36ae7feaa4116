"""LlamaConfig: the shape of a PagedLlama (and of its KV cache), and two presets."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LlamaConfig", "bench_config", "tiny_config"]


@dataclass
class LlamaConfig:
    num_layers: int = 8
    hidden_size: int = 512
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 1408
    vocab_size: int = 2048
    block_size: int = 16
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: torch.dtype = torch.float32
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Per-request matmuls: a request's results do not depend on the other requests
    # of the step (see the package docstring). False batches the projections/MLP.
    batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def kv_cache_shape(self, num_blocks: int) -> tuple:
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block(self) -> int:
        """Bytes of one block of ONE layer's cache."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


def tiny_config(**overrides) -> LlamaConfig:
    """A 2-layer, 64-wide model for fast unit tests."""
    kw = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
              intermediate_size=176, vocab_size=256, block_size=4)
    kw.update(overrides)
    return LlamaConfig(**kw)


def bench_config(num_layers: int = 8, hidden_size: int = 512, **overrides) -> LlamaConfig:
    """Benchmark preset: the default shape (prefill of 2k-4k tokens ~0.5-3 s on 2 CPU
    cores, see the package docstring) with ``num_layers`` / ``hidden_size`` scaled.
    Heads keep head_dim 64 and a 4:1 GQA ratio; intermediate ~ 2.75 x hidden (rounded
    to 16). Prefill time is ~linear in num_layers and ~quadratic in hidden_size."""
    num_heads = max(1, hidden_size // 64)
    kw = dict(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
              num_kv_heads=max(1, num_heads // 4),
              intermediate_size=int(round(hidden_size * 2.75 / 16)) * 16)
    kw.update(overrides)
    return LlamaConfig(**kw)
