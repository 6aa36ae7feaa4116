"""Tensor parallelism of attention KV heads: which heads each rank holds, which prefill
rank sends which heads to which decode rank, and the transfer units that address them.
Shared by the engine adapters (no engine import here).

Engines split the KV heads of a layer evenly over the tensor-parallel ranks; with fewer
KV heads than ranks (GQA), each head is replicated on ``tp / kv_heads`` consecutive
ranks. A transfer unit is one KV head of one *slot*, the engine's unit of KV placement
in which a rank's heads are stored side by side: a block for vLLM (its head-major
layout keeps a head of a block contiguous), a token for SGLang (its pool is token-major:
``[tokens, heads, head_dim]``). A rank's cache is viewed as ``[slots * local_heads,
...]`` and unit ``slot * local_heads + local_head`` addresses it. Runs of adjacent units
(all heads of adjacent slots) merge into one descriptor, so equal TP moves the same
descriptors as whole slots would.

Each destination head is sent once, by the lowest prefill rank that holds it (replicas
on other prefill ranks send nothing), of the prefill ranks the engine tells that decode
rank's destination to (SGLang tells it to some only). Every (prefill rank, decode rank)
pair that moves heads is one transfer "part" with its own id; a decode rank reports a
request when every part it expects has ended, and failed if any part failed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class HeadSlice:
    """The global KV heads ``[start, stop)`` one rank holds."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def rank_heads(total_kv_heads: int, tp_size: int, rank: int) -> HeadSlice:
    """The KV heads ``rank`` of ``tp_size`` holds (replicated when fewer than ranks), as
    vLLM and SGLang split them."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tensor parallel size {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not divide over {tp_size} ranks")
        per = total_kv_heads // tp_size
        return HeadSlice(rank * per, (rank + 1) * per)
    if tp_size % total_kv_heads:
        raise ValueError(f"{tp_size} ranks do not replicate {total_kv_heads} KV heads evenly")
    head = rank // (tp_size // total_kv_heads)
    return HeadSlice(head, head + 1)


def source_rank(head: int, total_kv_heads: int, tp_size: int, among: Optional[range] = None) -> int:
    """The lowest prefill rank holding ``head``, of ``among`` (default: all ranks; an
    engine that tells a decode rank's destination to some prefill ranks only names
    them): the one that sends it."""
    if total_kv_heads >= tp_size:
        lowest, replicas = head // (total_kv_heads // tp_size), 1
    else:
        replicas = tp_size // total_kv_heads
        lowest = head * replicas
    holders = range(lowest, lowest + replicas)
    for rank in holders if among is None else among:
        if rank in holders:
            return rank
    raise ValueError(f"none of prefill ranks {list(among)} holds KV head {head} "
                     f"({total_kv_heads} heads over {tp_size} ranks)")


def part_id(transfer_id: str, decode_engine: str, prefill_rank: int, decode_rank: int) -> str:
    """The id of one part. ``decode_engine`` is the receiving rank's connector engine
    id, a nonce of that decode process: a transfer id used again with a restarted
    decode instance cannot match anything reported before."""
    return f"{transfer_id}@{decode_engine}|p{prefill_rank}d{decode_rank}"


def expected_parts(transfer_id: str, decode_engine: str, block_ids: Sequence[int], total_kv_heads: int,
                   prefill_tp: int, decode_tp: int, decode_rank: int,
                   senders: Optional[range] = None) -> Dict[str, List[int]]:
    """Decode side: per part ``decode_rank`` receives for one request, the units of
    the slots ``block_ids`` it fills (the heads its prefill rank sends, PartPlan.units).
    ``senders``: the prefill ranks that may send to it (default: all)."""
    heads = rank_heads(total_kv_heads, decode_tp, decode_rank)
    local: Dict[int, List[int]] = {}  # prefill rank -> the local heads it sends here
    for h in range(heads.start, heads.stop):
        local.setdefault(source_rank(h, total_kv_heads, prefill_tp, senders), []).append(h - heads.start)
    slots = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)
    return {part_id(transfer_id, decode_engine, s, decode_rank):
            (slots * len(heads) + np.asarray(ks, dtype=np.int64)).ravel().tolist()
            for s, ks in sorted(local.items())}


@dataclass(frozen=True)
class PartPlan:
    """Prefill side: the heads one prefill rank sends to one decode rank."""

    decode_rank: int
    heads: HeadSlice  # global heads sent (a subrange of both ranks' heads)
    src_offset: int  # first sent head, counted in the prefill rank's local heads
    dst_offset: int  # ... in the decode rank's local heads
    src_heads: int  # local heads per block on the prefill rank
    dst_heads: int  # ... on the decode rank

    def units(self, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> Tuple[List[int], List[int]]:
        """Transfer units (one head of one slot) for these slot pairs."""
        return (_units(src_blocks, self.src_heads, self.src_offset, len(self.heads)),
                _units(dst_blocks, self.dst_heads, self.dst_offset, len(self.heads)))


def _units(slots: Sequence[int], heads_per_slot: int, first: int, count: int) -> List[int]:
    """Units ``first .. first + count`` of each slot, slot by slot."""
    slots = np.asarray(slots, dtype=np.int64).reshape(-1, 1)
    return (slots * heads_per_slot + first + np.arange(count, dtype=np.int64)).ravel().tolist()


def plan_parts(total_kv_heads: int, prefill_tp: int, prefill_rank: int, decode_tp: int,
               senders: Optional[Callable[[int], range]] = None) -> List[PartPlan]:
    """Prefill side: what ``prefill_rank`` sends to each decode rank (ranks it sends
    nothing to are left out). ``senders``: per decode rank, the prefill ranks that may
    send to it (default: all)."""
    mine = rank_heads(total_kv_heads, prefill_tp, prefill_rank)
    plans = []
    for d in range(decode_tp):
        theirs = rank_heads(total_kv_heads, decode_tp, d)
        among = None if senders is None else senders(d)
        if among is not None and prefill_rank not in among:
            continue
        sent = [h for h in range(max(mine.start, theirs.start), min(mine.stop, theirs.stop))
                if source_rank(h, total_kv_heads, prefill_tp, among) == prefill_rank]
        if sent:
            plans.append(PartPlan(d, HeadSlice(sent[0], sent[-1] + 1), sent[0] - mine.start,
                                  sent[0] - theirs.start, len(mine), len(theirs)))
    return plans
