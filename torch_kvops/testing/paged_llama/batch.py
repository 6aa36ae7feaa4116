"""One forward step's inputs (PagedBatch, built for prefill or decode) and the block
allocator that hands out KV-cache block ids."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

__all__ = ["BlockAllocator", "PagedBatch", "blocks_needed", "decode_batch", "prefill_batch"]


def _as_index_tensor(x, device=None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.to(dtype=torch.int64)
    else:
        t = torch.tensor(list(x), dtype=torch.int64)
    return t if device is None else t.to(device)


@dataclass
class PagedBatch:
    """One forward step over ``len(num_new_tokens)`` requests.

    - ``num_new_tokens[i]``: query tokens of request ``i`` in this step (Python int;
      the step's ``input_ids`` / ``positions`` are these runs concatenated in order).
    - ``context_lens[i]``: request ``i``'s total context after this step (Python int,
      >= num_new_tokens[i]); its new tokens sit at positions
      ``context_lens[i] - num_new_tokens[i] ... context_lens[i] - 1``.
    - ``block_tables[i]``: 1-D int64 tensor of block ids (lists are converted); at
      least ``ceil(context_lens[i] / block_size)`` entries, extra ones are ignored.
    - ``slot_mapping``: int64 ``[sum(num_new_tokens)]``, where each new token's K/V is
      written: ``block_id * block_size + offset``.
    """

    num_new_tokens: List[int]
    context_lens: List[int]
    block_tables: List[torch.Tensor]
    slot_mapping: torch.Tensor

    def __post_init__(self) -> None:
        self.num_new_tokens = [int(n) for n in self.num_new_tokens]
        self.context_lens = [int(n) for n in self.context_lens]
        self.block_tables = [_as_index_tensor(b) for b in self.block_tables]
        self.slot_mapping = _as_index_tensor(self.slot_mapping)
        if not (len(self.num_new_tokens) == len(self.context_lens) == len(self.block_tables)):
            raise ValueError("num_new_tokens, context_lens and block_tables differ in length")
        for n, c in zip(self.num_new_tokens, self.context_lens):
            if n < 1 or c < n:
                raise ValueError(f"bad request: num_new_tokens={n}, context_len={c}")
        if self.slot_mapping.shape != (self.num_tokens,):
            raise ValueError(f"slot_mapping shape {tuple(self.slot_mapping.shape)} != "
                             f"({self.num_tokens},)")

    @property
    def num_requests(self) -> int:
        return len(self.num_new_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def to(self, device) -> "PagedBatch":
        return PagedBatch(self.num_new_tokens, self.context_lens,
                          [b.to(device) for b in self.block_tables],
                          self.slot_mapping.to(device))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def _slots(block_table: Sequence[int], start: int, stop: int, block_size: int) -> List[int]:
    bt = list(block_table)
    if blocks_needed(stop, block_size) > len(bt):
        raise ValueError(f"block table of {len(bt)} blocks cannot hold {stop} tokens "
                         f"(block_size {block_size})")
    return [bt[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def _table_list(bt) -> List[int]:
    return bt.tolist() if isinstance(bt, torch.Tensor) else [int(b) for b in bt]


def prefill_batch(prompts: Sequence[Sequence[int]], block_tables: Sequence[Sequence[int]],
                  start_positions: Optional[Sequence[int]] = None, block_size: int = 16,
                  device="cpu"):
    """Build ``(input_ids, positions, batch)`` for one prefill step.

    ``prompts[i]`` are the tokens to process in this step for request ``i``; with
    ``start_positions`` (chunked prefill) they sit at positions ``start_positions[i] ...``,
    the earlier positions already being in the cache. ``block_tables[i]`` must cover
    ``start + len(prompts[i])`` tokens.
    """
    if start_positions is None:
        start_positions = [0] * len(prompts)
    ids, pos, slots, n_new, ctx = [], [], [], [], []
    for toks, bt, start in zip(prompts, block_tables, start_positions):
        toks = [int(t) for t in toks]
        stop = start + len(toks)
        ids += toks
        pos += range(start, stop)
        slots += _slots(_table_list(bt), start, stop, block_size)
        n_new.append(len(toks))
        ctx.append(stop)
    batch = PagedBatch(n_new, ctx, [_as_index_tensor(_table_list(b)) for b in block_tables],
                       torch.tensor(slots, dtype=torch.int64))
    return (torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(pos, dtype=torch.int64, device=device), batch.to(device))


def decode_batch(tokens: Sequence[int], context_lens: Sequence[int],
                 block_tables: Sequence[Sequence[int]], block_size: int = 16, device="cpu"):
    """Build ``(input_ids, positions, batch)`` for one decode step: request ``i`` feeds
    ``tokens[i]`` at position ``context_lens[i] - 1`` (``context_lens`` counts the token
    fed now). ``block_tables[i]`` must cover ``context_lens[i]`` tokens."""
    slots = []
    for c, bt in zip(context_lens, block_tables):
        slots += _slots(_table_list(bt), c - 1, c, block_size)
    batch = PagedBatch([1] * len(tokens), list(context_lens),
                       [_as_index_tensor(_table_list(b)) for b in block_tables],
                       torch.tensor(slots, dtype=torch.int64))
    return (torch.tensor([int(t) for t in tokens], dtype=torch.int64, device=device),
            torch.tensor([c - 1 for c in context_lens], dtype=torch.int64, device=device),
            batch.to(device))


class BlockAllocator:
    """Free list of block ids ``0 .. num_blocks-1``; allocates lowest ids first."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = int(num_blocks)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() from the end
        self._used = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> List[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: want {n}, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            b = int(b)
            if b not in self._used:
                raise ValueError(f"block {b} is not allocated")
            self._used.remove(b)
            self._free.append(b)
        self._free.sort(reverse=True)
