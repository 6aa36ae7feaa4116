"""MHA pools moved by KV head (``"mha_unit": "head"``, settings.py), so attention TP
sizes need not match.

SGLang's MHA pool is token-major: each layer's K and V buffer is ``[tokens, local
heads, head_dim]``, pages of ``page_size`` tokens. A prefill rank with other heads than
its decode rank must write a head range of every token, so the backend registers each
buffer as units of one head of one token (the shared core's slots are tokens here:
:mod:`torch_kvops.heads`). Equal TP sizes move every head of a page's tokens, adjacent
units that merge into one descriptor per run of pages, as whole pages would; unequal
sizes move ``heads * head_dim`` bytes per token. The cost is per token: a room's
destination lists, and its integrity digests (one per unit and layer), are page size x
local heads times those of whole pages (for 3000 tokens of 8 KV heads in pages of 16,
24064 units per buffer; "mac" digests about 1 s of a core per room, against 47 ms by
page), so ``"page"``, the default, moves whole pages between equal sizes.

Each (prefill rank, decode rank) pair that moves heads is a transfer of its own (a
part, :func:`torch_kvops.heads.part_id` of the room), and the decode rank expects one
part per prefill rank that sends it heads. MLA pools hold one latent per token,
registered by page (no head axis): :mod:`.transfers`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ...heads import PartPlan, expected_parts, part_id, plan_parts, rank_heads


def destination_ranks(prefill_tp: int, decode_tp: int, decode_rank: int) -> range:
    """The prefill ranks SGLang sends ``decode_rank``'s destination of a room to (its
    ``CommonKVReceiver`` rank mapping for MHA, read from SGLang 0.5.23): the same rank
    between equal sizes; with more decode ranks, the one its rank divides down to; with
    more prefill ranks, the run of them that holds its heads. Only these may send it
    heads, so a head replicated on several prefill ranks comes from the lowest of them."""
    if prefill_tp >= decode_tp:
        per = prefill_tp // decode_tp
        return range(decode_rank * per, (decode_rank + 1) * per)
    first = decode_rank // (decode_tp // prefill_tp)
    return range(first, first + 1)


def page_tokens(pages: Sequence[int], page_size: int) -> np.ndarray:
    """The token slots of ``pages``, page by page."""
    pages = np.asarray(pages, dtype=np.int64).reshape(-1, 1)
    return (pages * page_size + np.arange(page_size, dtype=np.int64)).ravel()


@dataclass(frozen=True)
class RankHeads:
    """The KV heads of one attention TP rank of an MHA model."""

    total: int  # KV heads of the model
    tp_size: int  # attention TP size
    rank: int  # attention TP rank
    page_size: int

    def __post_init__(self) -> None:
        rank_heads(self.total, self.tp_size, self.rank)  # raises if the heads do not split

    @property
    def local(self) -> int:
        return len(rank_heads(self.total, self.tp_size, self.rank))

    def unit_views(self, pages: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """``[pages, page_bytes]`` buffers as ``[tokens * local heads, head_bytes]``."""
        per_page = self.page_size * self.local
        views = []
        for i, buffer in enumerate(pages):
            page_bytes = buffer.size(1)
            if page_bytes % per_page:
                raise ValueError(f"KV buffer {i}: pages of {page_bytes} bytes do not split into "
                                 f"{self.page_size} tokens of {self.local} KV heads")
            views.append(buffer.view(buffer.size(0) * per_page, page_bytes // per_page))
        return views

    def tp_problem(self, peer_tp: int) -> str:
        """Why heads cannot move to or from a peer of attention TP ``peer_tp``, or ""."""
        try:
            rank_heads(self.total, peer_tp, 0)
        except ValueError as exc:
            return f"attention TP {peer_tp} against {self.tp_size} here: {exc}"
        return ""

    def plan_to(self, decode_tp: int, decode_rank: int) -> Optional[PartPlan]:
        """Prefill: the heads this rank sends that decode rank (None: a replica of
        them on a lower prefill rank of those SGLang tells that rank's destination to
        sends them)."""
        if not 0 <= decode_rank < decode_tp:
            raise ValueError(f"decode rank {decode_rank} of attention TP {decode_tp}")
        senders = functools.partial(destination_ranks, self.tp_size, decode_tp)
        for plan in plan_parts(self.total, self.tp_size, self.rank, decode_tp, senders):
            if plan.decode_rank == decode_rank:
                return plan
        return None

    def expected(self, room: int, session: str, pages: Sequence[int], prefill_tp: int) -> Dict[str, List[int]]:
        """Decode: per part of ``room`` this rank receives (one per sending prefill
        rank), the units of ``pages`` it fills."""
        return expected_parts(str(room), session, page_tokens(pages, self.page_size), self.total,
                              prefill_tp, self.tp_size, self.rank,
                              destination_ranks(prefill_tp, self.tp_size, self.rank))

    def part(self, room: int, session: str, decode_rank: int) -> str:
        """Prefill: the id of this rank's part of ``room`` to that decode rank."""
        return part_id(str(room), session, self.rank, decode_rank)


def moved_by(heads: Optional[RankHeads]) -> str:
    """What one unit of this rank's transfers is, for its log."""
    return "page" if heads is None else f"KV head ({heads.local} of {heads.total})"
