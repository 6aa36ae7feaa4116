"""Driving a PagedLlama: prefill (chunked or not), decode from a cache filled elsewhere
(the decode side of disaggregation), and monolithic greedy generation."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .batch import BlockAllocator, blocks_needed, decode_batch, prefill_batch
from .config import LlamaConfig

__all__ = ["decode_from_cache", "generate", "prefill"]


def _ensure_blocks(block_table: List[int], num_tokens: int, block_size: int,
                   allocator: Optional[BlockAllocator]) -> None:
    need = blocks_needed(num_tokens, block_size) - len(block_table)
    if need > 0:
        if allocator is None:
            raise ValueError(f"block table of {len(block_table)} blocks cannot hold "
                             f"{num_tokens} tokens and no allocator was given")
        block_table.extend(allocator.allocate(need))


@torch.no_grad()
def prefill(model, prompts: Sequence[Sequence[int]], kv_caches: Sequence[torch.Tensor],
            block_tables: List[List[int]], chunk_size: Optional[int] = None,
            allocator: Optional[BlockAllocator] = None, forward=None) -> List[int]:
    """Prefill every prompt (all requests together in each step; with ``chunk_size``,
    step ``s`` feeds tokens ``s*chunk_size ...`` of each prompt still unfinished) and
    return each request's first generated token (argmax of its last prefill logits).

    ``block_tables[i]`` (a list, extended in place from ``allocator`` if short) must end
    up covering the prompt. ``forward`` defaults to ``model`` (pass a compiled one)."""
    cfg = _cfg(model)
    forward = model if forward is None else forward
    device = kv_caches[0].device
    for p, bt in zip(prompts, block_tables):
        _ensure_blocks(bt, len(p), cfg.block_size, allocator)
    first = [None] * len(prompts)
    longest = max(len(p) for p in prompts)
    step = longest if chunk_size is None else chunk_size
    for start in range(0, longest, step):
        live = [i for i, p in enumerate(prompts) if start < len(p)]
        ids, pos, batch = prefill_batch([prompts[i][start:start + step] for i in live],
                                        [block_tables[i] for i in live],
                                        [start] * len(live), cfg.block_size, device)
        logits = forward(ids, pos, kv_caches, batch)
        for row, i in enumerate(live):
            if start + step >= len(prompts[i]):
                first[i] = int(logits[row].argmax())
    return first


@torch.no_grad()
def decode_from_cache(model, prompts: Sequence[Sequence[int]], first_tokens: Sequence[int],
                      block_tables: List[List[int]], kv_caches: Sequence[torch.Tensor],
                      max_new_tokens: int, allocator: Optional[BlockAllocator] = None,
                      forward=None) -> List[List[int]]:
    """The decode side of a disaggregated setup: the K/V of every prompt token is
    already in ``kv_caches`` (in this side's ``block_tables[i]``, positions
    ``0 .. len(prompts[i])-1``) and ``first_tokens[i]`` is the prefill side's argmax.
    Greedy-decodes the rest; returns ``max_new_tokens`` tokens per request, the first
    being ``first_tokens[i]`` (so equal to :func:`generate`'s output).

    Only ``len(prompts[i])`` is used from the prompts. Block tables are lists extended
    in place (from ``allocator``) to hold ``len(prompt) + max_new_tokens - 1`` tokens;
    without an allocator they must already be that long. The caller frees them.
    """
    cfg = _cfg(model)
    forward = model if forward is None else forward
    device = kv_caches[0].device
    out = [[int(t)] for t in first_tokens]
    lens = [len(p) for p in prompts]
    for step in range(max_new_tokens - 1):
        ctx = [n + step + 1 for n in lens]
        for c, bt in zip(ctx, block_tables):
            _ensure_blocks(bt, c, cfg.block_size, allocator)
        ids, pos, batch = decode_batch([o[-1] for o in out], ctx, block_tables,
                                       cfg.block_size, device)
        logits = forward(ids, pos, kv_caches, batch)
        nxt = logits.argmax(dim=-1).tolist()
        for o, t in zip(out, nxt):
            o.append(int(t))
    return out


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             kv_caches: Sequence[torch.Tensor], allocator: BlockAllocator,
             chunk_size: Optional[int] = None, forward=None,
             free_blocks: bool = True) -> List[List[int]]:
    """Monolithic greedy generation: :func:`prefill` (chunked if ``chunk_size``) then
    :func:`decode_from_cache` in the same cache. Returns ``max_new_tokens`` tokens per
    prompt. Blocks come from ``allocator`` and are freed at the end (``free_blocks``)."""
    block_tables: List[List[int]] = [[] for _ in prompts]
    try:
        first = prefill(model, prompts, kv_caches, block_tables, chunk_size, allocator,
                        forward)
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        return decode_from_cache(model, prompts, first, block_tables, kv_caches,
                                 max_new_tokens, allocator, forward)
    finally:
        if free_blocks:
            for bt in block_tables:
                allocator.free(bt)


def _cfg(model) -> LlamaConfig:
    m = getattr(model, "_orig_mod", model)
    return m.cfg
