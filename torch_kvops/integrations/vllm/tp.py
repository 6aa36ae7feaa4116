"""Tensor parallelism in vLLM: which prefill rank sends which part of a request to which
decode rank. The head split and the parts of an MHA cache are the shared core's
(:mod:`torch_kvops.heads`; a slot there is one vLLM block: with vLLM's CPU layout
``[num_blocks, kv_heads, block_size, 2 * head]`` a head of a block is contiguous, so a
rank's cache is viewed as ``[num_blocks * local_heads, block_size, 2 * head]``).

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

from ...heads import part_id, rank_heads


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
