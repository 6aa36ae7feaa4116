"""Tensor parallelism: which KV heads each rank holds, which prefill rank sends which
heads to which decode rank, and the transfer units that address them.

vLLM splits the KV heads of a layer evenly over the tensor-parallel ranks; with fewer
KV heads than ranks (GQA), each head is replicated on ``tp / kv_heads`` consecutive
ranks. A transfer unit is one KV head of one block: with vLLM's CPU layout
``[num_blocks, kv_heads, block_size, 2 * head]`` a head of a block is contiguous, so a
rank's cache is viewed as ``[num_blocks * local_heads, block_size, 2 * head]`` and unit
``block * local_heads + local_head`` addresses it. Runs of adjacent units (all heads of
adjacent blocks) merge into one descriptor, so equal TP moves the same descriptors as
whole blocks would.

Each destination head is sent once, by the lowest prefill rank that holds it (replicas
on other prefill ranks send nothing). Every (prefill rank, decode rank) pair that moves
heads is one transfer "part" with its own id; a decode rank reports a request when
every part it expects has ended, and failed if any part failed.

MLA (latent) caches have no head axis: every rank holds the same latent of every
block (``[num_blocks, block_size, 576]``), so every decode rank needs every block,
and the unit is a whole block. The prefill ranks share the sending (latent_parts):
the request's pushed blocks are cut into ``prefill_tp`` contiguous segments whose
sizes differ by at most one, and prefill rank ``p`` sends segment ``(p + d) %
prefill_tp`` to decode rank ``d``. Contiguous segments keep a rank's blocks adjacent,
so a layer's blocks still merge into few descriptors (interleaving blocks would
make every block its own descriptor); rotating the segment by decode rank spreads
the larger segments over the prefill ranks. Segments are cut on the request's
positions, not per chunk, so a block pushed again by the next chunk (cut by a chunk
boundary) goes from the same rank, and each decode rank knows from the request's
block count alone which prefill ranks send it something.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple


@dataclass(frozen=True)
class HeadSlice:
    """The global KV heads ``[start, stop)`` one rank holds."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def rank_heads(total_kv_heads: int, tp_size: int, rank: int) -> HeadSlice:
    """The KV heads vLLM gives ``rank`` of ``tp_size`` (replicated when fewer than ranks)."""
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


def source_rank(head: int, total_kv_heads: int, tp_size: int) -> int:
    """The lowest prefill rank holding ``head``: the one that sends it."""
    if total_kv_heads >= tp_size:
        return head // (total_kv_heads // tp_size)
    return head * (tp_size // total_kv_heads)


def part_id(transfer_id: str, decode_engine: str, prefill_rank: int, decode_rank: int) -> str:
    """The id of one part. ``decode_engine`` is the receiving rank's connector engine
    id, a nonce of that decode process: a transfer id used again with a restarted
    decode instance cannot match anything reported before."""
    return f"{transfer_id}@{decode_engine}|p{prefill_rank}d{decode_rank}"


def expected_parts(transfer_id: str, decode_engine: str, block_ids: Sequence[int], total_kv_heads: int,
                   prefill_tp: int, decode_tp: int, decode_rank: int) -> Dict[str, List[int]]:
    """Decode side: per part ``decode_rank`` receives for one request, the units of
    ``block_ids`` it fills (the heads its prefill rank sends, PartPlan.units)."""
    heads = rank_heads(total_kv_heads, decode_tp, decode_rank)
    local: Dict[int, List[int]] = {}  # prefill rank -> the local heads it sends here
    for h in range(heads.start, heads.stop):
        local.setdefault(source_rank(h, total_kv_heads, prefill_tp), []).append(h - heads.start)
    return {part_id(transfer_id, decode_engine, s, decode_rank): [b * len(heads) + k for b in block_ids for k in ks]
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
        """Transfer units (one head of one block) for these block pairs."""
        n = len(self.heads)
        src = [b * self.src_heads + self.src_offset + k for b in src_blocks for k in range(n)]
        dst = [b * self.dst_heads + self.dst_offset + k for b in dst_blocks for k in range(n)]
        return src, dst


def plan_parts(total_kv_heads: int, prefill_tp: int, prefill_rank: int, decode_tp: int) -> List[PartPlan]:
    """Prefill side: what ``prefill_rank`` sends to each decode rank (ranks it sends
    nothing to are left out)."""
    mine = rank_heads(total_kv_heads, prefill_tp, prefill_rank)
    plans = []
    for d in range(decode_tp):
        theirs = rank_heads(total_kv_heads, decode_tp, d)
        sent = [h for h in range(max(mine.start, theirs.start), min(mine.stop, theirs.stop))
                if source_rank(h, total_kv_heads, prefill_tp) == prefill_rank]
        if sent:
            plans.append(PartPlan(d, HeadSlice(sent[0], sent[-1] + 1), sent[0] - mine.start,
                                  sent[0] - theirs.start, len(mine), len(theirs)))
    return plans


def latent_segment(total_blocks: int, prefill_tp: int, segment: int) -> range:
    """Positions (in a request's pushed blocks) of contiguous segment ``segment`` of
    ``prefill_tp``; segment sizes differ by at most one."""
    if not 0 <= segment < prefill_tp:
        raise ValueError(f"segment {segment} out of range for prefill tensor parallel size {prefill_tp}")
    if total_blocks < 0:
        raise ValueError(f"a request cannot push {total_blocks} blocks")
    return range(segment * total_blocks // prefill_tp, (segment + 1) * total_blocks // prefill_tp)


def latent_share(total_blocks: int, prefill_tp: int, prefill_rank: int, decode_rank: int) -> range:
    """MLA: the positions ``prefill_rank`` sends to ``decode_rank`` (module docstring)."""
    return latent_segment(total_blocks, prefill_tp, (prefill_rank + decode_rank) % prefill_tp)


@dataclass(frozen=True)
class LatentPart:
    """Prefill side, MLA: the positions one prefill rank sends to one decode rank."""

    decode_rank: int
    positions: range

    def chunk(self, block_offset: int, src_blocks: Sequence[int], dst_blocks: Sequence[int]
              ) -> Tuple[List[int], List[int]]:
        """The (src, dst) blocks of this part in a chunk whose first block is at
        position ``block_offset`` of the request's pushed blocks."""
        lo = max(self.positions.start - block_offset, 0)
        hi = min(self.positions.stop - block_offset, len(src_blocks))
        if hi <= lo:
            return [], []
        return list(src_blocks[lo:hi]), list(dst_blocks[lo:hi])


def latent_parts(total_blocks: int, prefill_tp: int, prefill_rank: int, decode_tp: int) -> List[LatentPart]:
    """Prefill side, MLA: what ``prefill_rank`` sends to each decode rank of a request
    pushing ``total_blocks`` blocks (ranks it sends nothing to are left out)."""
    parts = [LatentPart(d, latent_share(total_blocks, prefill_tp, prefill_rank, d)) for d in range(decode_tp)]
    return [p for p in parts if len(p.positions)]


def latent_expected_parts(transfer_id: str, decode_engine: str, block_ids: Sequence[int], prefill_tp: int,
                          decode_rank: int) -> Dict[str, List[int]]:
    """Decode side, MLA: per part ``decode_rank`` receives for a request that pushes
    ``block_ids``, the blocks it fills (a prefill rank with an empty share sends none)."""
    shares = {p: latent_share(len(block_ids), prefill_tp, p, decode_rank) for p in range(prefill_tp)}
    return {part_id(transfer_id, decode_engine, p, decode_rank): [block_ids[i] for i in share]
            for p, share in shares.items() if len(share)}


def check_tp(total_kv_heads: int, tp_size: int, use_mla: bool, pp_size: int) -> None:
    """Refuse at start-up what the connector cannot move, naming the setting."""
    if pp_size != 1:
        raise ValueError(f"KvopsLayerwiseConnector: pipeline parallelism (pipeline_parallel_size="
                         f"{pp_size}) is not supported")
    if use_mla:
        return  # one latent, replicated on every rank: moved by whole blocks
    rank_heads(total_kv_heads, tp_size, 0)  # raises if the heads do not split evenly


def merge_decode_peers(handshakes: Dict[int, dict]) -> List[dict]:
    """Decode scheduler: the per-rank peer infos of its workers, ordered by rank."""
    ranks = sorted(handshakes)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"decode worker handshakes from ranks {ranks}, expected 0..{len(ranks) - 1}")
    return [handshakes[r] for r in ranks]
