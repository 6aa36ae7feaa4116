"""Transfer planning: KV layouts, request validation, per-layer copy descriptors.

Pure Python/numpy, no I/O: the connector validates a step here before anything is
sent, and the sender turns each layer into merged (src, dst, length) descriptors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np
import torch


@dataclass(frozen=True)
class TransferRequest:
    """Blocks of one request to push to one peer in this step.

    ``src_blocks[k]`` (a block of the producer's caches) lands in ``dst_blocks[k]`` (a
    block of the peer's caches) for every layer. A request spanning several steps
    (chunked prefill) is sent with ``last_chunk=False`` until its final chunk; the
    consumer reports it finished only after every layer of every chunk landed.

    ``layer_first_block`` (layer -> k): that layer moves only ``src_blocks[k:]``, the
    blocks before them are not moved for it (a sliding-window layer's blocks before its
    window, which the consumer never reads); layers not named move every block. With
    block spaces (``KVLayout.of``), ids are global and each layer must move ids of its
    own space only: a request for one space names every other space's layers with
    k = the number of its blocks (they move none).
    """

    req_id: str
    peer: str
    src_blocks: Sequence[int]
    dst_blocks: Sequence[int]
    last_chunk: bool = True
    layer_first_block: Optional[Mapping[int, int]] = field(default=None, hash=False)

    def first_block(self, layer: int) -> int:
        """The index of the first block ``layer`` moves (0: every block)."""
        return self.layer_first_block.get(layer, 0) if self.layer_first_block else 0


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's blocks live: base address, block count, stride, block size,
    and the id of its block 0 (``id_base``: 0 unless the caches have several block
    spaces, see :meth:`KVLayout.of`)."""

    base: int
    num_blocks: int
    block_stride: int  # bytes between consecutive blocks
    block_bytes: int  # bytes in one block (contiguous)
    dtype: str
    id_base: int = 0  # block id k of this layer is its block k - id_base

    @staticmethod
    def of(cache: torch.Tensor, id_base: int = 0) -> "LayerLayout":
        if cache.dim() < 1 or cache.size(0) == 0:
            raise ValueError(f"a KV cache needs blocks along dim 0, got shape {tuple(cache.shape)}")
        block = cache[0]
        if not block.is_contiguous():
            raise ValueError(f"blocks must be contiguous (shape {tuple(cache.shape)}, "
                             f"strides {cache.stride()})")
        return LayerLayout(base=cache.data_ptr(), num_blocks=cache.size(0),
                           block_stride=cache.stride(0) * cache.element_size(),
                           block_bytes=block.numel() * cache.element_size(),
                           dtype=str(cache.dtype).replace("torch.", ""), id_base=id_base)

    def span(self) -> Tuple[int, int]:
        """(address, length) of the memory to register for this layer."""
        return self.base, (self.num_blocks - 1) * self.block_stride + self.block_bytes

    def first_outside(self, blocks: np.ndarray) -> Optional[int]:
        """The first id of ``blocks`` that names no block of this layer, if any."""
        end = self.id_base + self.num_blocks
        if not blocks.size or (blocks.min() >= self.id_base and blocks.max() < end):
            return None  # every step's check: two reductions, no mask
        return int(blocks[(blocks < self.id_base) | (blocks >= end)][0])


@dataclass(frozen=True)
class KVLayout:
    layers: Tuple[LayerLayout, ...]

    @staticmethod
    def of(caches: Sequence[torch.Tensor], spaces: Optional[Sequence[int]] = None) -> "KVLayout":
        """The layout of ``caches``. ``spaces`` (one per layer, numbered from 0 in
        order) puts layers whose blocks are allocated apart (a hybrid pool's sliding
        layers, whose pages are not the full layers' pages) in block spaces of their
        own: a request names global ids, space 0's from 0, each next space's from
        past the last id of the one before, and each layer moves the ids of its space."""
        if len(caches) == 0:
            raise ValueError("register_kv_caches needs at least one layer")
        bases = [0] * len(caches)
        if spaces is not None:
            spaces = list(spaces)
            if len(spaces) != len(caches) or any(type(s) is not int for s in spaces):
                raise ValueError(f"spaces: one int per layer ({len(caches)} layers), got {spaces!r}")
            if sorted(set(spaces)) != list(range(len(set(spaces)))):
                raise ValueError(f"spaces must be numbered 0, 1, ... without gaps, got {sorted(set(spaces))}")
            sizes = [max(c.size(0) for c, s in zip(caches, spaces) if s == space)
                     for space in range(len(set(spaces)))]
            bases = [sum(sizes[:space]) for space in spaces]
        return KVLayout(tuple(LayerLayout.of(c, base) for c, base in zip(caches, bases)))

    @property
    def spaced(self) -> bool:
        """Whether the layers have more than one block space."""
        return any(layer.id_base for layer in self.layers)

    @property
    def id_bases(self) -> List[int]:
        return [layer.id_base for layer in self.layers]

    @property
    def spaces(self) -> List[int]:
        """Each layer's block space, numbered from 0."""
        bases = sorted(set(self.id_bases))
        return [bases.index(base) for base in self.id_bases]

    @property
    def num_ids(self) -> int:
        """Block ids run from 0 to this, over every space."""
        return max(layer.id_base + layer.num_blocks for layer in self.layers)

    @property
    def id_limit(self) -> int:
        """Block ids a request may name are below this: without spaces, the fewest
        blocks of any layer (every layer holds every id); with spaces, ``num_ids``
        (each layer's own ids are checked apart, ``validate_step``)."""
        return self.num_ids if self.spaced else min(layer.num_blocks for layer in self.layers)

    def to_json(self) -> List[dict]:
        return [layer.__dict__.copy() for layer in self.layers]

    @staticmethod
    def from_json(data: List[dict]) -> "KVLayout":
        return KVLayout(tuple(LayerLayout(**d) for d in data))

    def check_compatible(self, peer: "KVLayout") -> None:
        """A producer can push into a peer only if every layer's blocks match."""
        if len(peer.layers) != len(self.layers):
            raise ValueError(f"peer has {len(peer.layers)} layers, this side has {len(self.layers)}")
        for i, (mine, theirs) in enumerate(zip(self.layers, peer.layers)):
            if mine.block_bytes != theirs.block_bytes or mine.dtype != theirs.dtype:
                raise ValueError(
                    f"layer {i}: peer blocks are {theirs.block_bytes} bytes of {theirs.dtype}, "
                    f"this side's are {mine.block_bytes} bytes of {mine.dtype}")
        if self.spaces != peer.spaces:
            raise ValueError("the peer's layers are not in the same block spaces as this side's "
                             f"(first ids: peer {peer.id_bases}, this side {self.id_bases})")


@dataclass
class StepPlan:
    """A validated step: requests grouped by peer, with block ids as int64 arrays, and
    (``partial`` validation) the requests refused, each with the reason."""

    requests: List[TransferRequest]
    by_peer: Dict[str, List[Tuple[TransferRequest, np.ndarray, np.ndarray]]] = field(default_factory=dict)
    refused: Dict[str, Tuple[TransferRequest, str]] = field(default_factory=dict)

    def refuse(self, requests: Sequence[TransferRequest], reason: str) -> None:
        """Refuse these requests (validated, or refused already) for ``reason``."""
        self.drop({req.req_id for req in requests})
        for req in requests:
            self.refused[req.req_id] = (req, reason)

    def drop(self, req_ids: Set[str]) -> None:
        """Remove these requests (validated, but not to be sent) from the plan."""
        self.requests = [r for r in self.requests if r.req_id not in req_ids]
        for peer, entries in self.by_peer.items():
            self.by_peer[peer] = [e for e in entries if e[0].req_id not in req_ids]


def validate_step(requests: Sequence[TransferRequest], local: KVLayout,
                  peers: Dict[str, KVLayout], in_flight: Dict[str, str],
                  partial: bool = False) -> StepPlan:
    """Return the plan; raise ``ValueError`` for a bad request, or with ``partial``
    refuse that request alone (``plan.refused``) and plan the others.

    Checked per request: unknown peer, length mismatch, block ids out of range locally
    or on the peer, a destination block named twice for one peer in this step (the
    later request naming it is the one refused). Always raised, whatever ``partial``
    (ids are the engine's to keep unique): a request id twice in the step, a request id
    already in flight with another peer.
    """
    plan = StepPlan(requests=[])
    ids = [req.req_id for req in requests]
    if len(set(ids)) != len(ids):
        twice = next(r for r in ids if ids.count(r) > 1)
        raise ValueError(f"request {twice!r} appears twice in one step")
    for req in requests:
        if in_flight.get(req.req_id, req.peer) != req.peer:
            raise ValueError(f"request {req.req_id!r} is in flight to peer {in_flight[req.req_id]!r}, "
                             f"not {req.peer!r}")
        try:
            src, dst = _checked_blocks(req, local, peers)
            _check_first_blocks(req, src.size, len(local.layers))
            if local.spaced:
                _check_spaces(req, src, dst, local, peers[req.peer])
        except ValueError as exc:
            if not partial:
                raise
            plan.refused[req.req_id] = (req, str(exc))
            continue
        plan.by_peer.setdefault(req.peer, []).append((req, src, dst))
    for peer, entries in plan.by_peer.items():
        all_dst = np.concatenate([dst for _, _, dst in entries])
        if np.unique(all_dst).size == all_dst.size:
            continue  # the usual case: one vectorised check
        named: Dict[int, str] = {}  # destination block -> the request naming it first
        for req, _, dst in entries:
            mine = dst.tolist()
            clash = next((b for b in mine if b in named), None)
            if clash is None and len(set(mine)) != len(mine):
                clash = next(b for b in mine if mine.count(b) > 1)
            if clash is None:
                named.update(dict.fromkeys(mine, req.req_id))
                continue
            reason = (f"destination block {clash} on peer {peer!r} is named twice "
                      f"(requests {sorted({named.get(clash, req.req_id), req.req_id})})")
            if not partial:
                raise ValueError(reason)
            plan.refused[req.req_id] = (req, reason)  # the later request naming it
        plan.by_peer[peer] = [e for e in entries if e[0].req_id not in plan.refused]
    plan.requests = [req for req in requests if req.req_id not in plan.refused]
    return plan


def _checked_blocks(req: TransferRequest, local: KVLayout,
                    peers: Dict[str, KVLayout]) -> Tuple[np.ndarray, np.ndarray]:
    """One request's (src, dst) block ids, or ValueError."""
    if req.peer not in peers:
        raise ValueError(f"request {req.req_id!r}: unknown peer {req.peer!r} (add_peer first)")
    src = _block_ids(req.req_id, "src_blocks", req.src_blocks)
    dst = _block_ids(req.req_id, "dst_blocks", req.dst_blocks)
    if src.shape != dst.shape:
        raise ValueError(f"request {req.req_id!r}: {src.size} source blocks but "
                         f"{dst.size} destination blocks")
    _check_range(req.req_id, "source", src, local.id_limit, "locally")
    _check_range(req.req_id, "destination", dst, peers[req.peer].id_limit, f"on peer {req.peer!r}")
    return src, dst


def _check_spaces(req: TransferRequest, src: np.ndarray, dst: np.ndarray, local: KVLayout,
                  peer: KVLayout) -> None:
    """With block spaces: the ids each layer moves (from its first block on) are ids
    of that layer's space, on both sides."""
    checked = set()
    for i, (mine, theirs) in enumerate(zip(local.layers, peer.layers)):
        first = req.first_block(i)
        key = (first, mine.id_base, mine.num_blocks, theirs.id_base, theirs.num_blocks)
        if key in checked:
            continue
        checked.add(key)
        for side, blocks, layer, where in (("source", src, mine, "locally"),
                                           ("destination", dst, theirs, f"on peer {req.peer!r}")):
            bad = layer.first_outside(blocks[first:])
            if bad is not None:
                raise ValueError(f"request {req.req_id!r}: {side} block {bad} is not a block of layer "
                                 f"{i} {where} (its ids: {layer.id_base} to "
                                 f"{layer.id_base + layer.num_blocks - 1}; name it from that "
                                 "layer's first block on, layer_first_block)")


def _check_first_blocks(req: TransferRequest, num_blocks: int, num_layers: int) -> None:
    """``layer_first_block`` names layers of the caches, each with an index within the
    request's blocks, and some layer moves some block (a request moving nothing has
    no blocks)."""
    firsts = req.layer_first_block
    if not firsts:
        return
    for layer, first in firsts.items():
        if type(layer) is not int or not 0 <= layer < num_layers:
            raise ValueError(f"request {req.req_id!r}: layer_first_block names layer {layer!r} "
                             f"({num_layers} layers)")
        if type(first) is not int or not 0 <= first <= num_blocks:
            raise ValueError(f"request {req.req_id!r}: layer_first_block[{layer}] = {first!r} "
                             f"is not within its {num_blocks} blocks")
    if num_blocks and len(firsts) == num_layers and min(firsts.values()) == num_blocks:
        raise ValueError(f"request {req.req_id!r}: layer_first_block moves none of its {num_blocks} "
                         "blocks in any layer (name no blocks instead)")


def _block_ids(req_id: str, name: str, blocks) -> np.ndarray:
    """Block ids as int64, refusing floats (silently truncated otherwise) and overflow."""
    try:
        arr = np.asarray(blocks)
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"request {req_id!r}: {name} must be integers, got {arr.dtype}")
        return arr.astype(np.int64, casting="safe" if arr.dtype.kind == "i" else "unsafe").reshape(-1)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"request {req_id!r}: bad {name}: {exc}") from exc


def _check_range(req_id: str, what: str, blocks: np.ndarray, limit: int, where: str) -> None:
    bad = blocks[(blocks < 0) | (blocks >= limit)]
    if bad.size:
        raise ValueError(f"request {req_id!r}: {what} block {int(bad[0])} is out of range {where} "
                         f"({limit} blocks)")


def layer_descriptors(local: LayerLayout, peer: LayerLayout, src_blocks: np.ndarray,
                      dst_blocks: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_addrs, dst_addrs, lengths) for one layer, runs of adjacent blocks merged."""
    if src_blocks.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    src = local.base + (src_blocks - local.id_base) * local.block_stride
    dst = peer.base + (dst_blocks - peer.id_base) * peer.block_stride
    return merge_runs(src, dst, np.full(src.shape, local.block_bytes, dtype=np.int64))


def merge_runs(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray
               ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive descriptors whose source and destination both continue."""
    if src.size <= 1:
        return src, dst, lengths
    ends_src = src[:-1] + lengths[:-1]
    ends_dst = dst[:-1] + lengths[:-1]
    starts = np.concatenate(([True], (src[1:] != ends_src) | (dst[1:] != ends_dst)))
    idx = np.flatnonzero(starts)
    merged_len = np.add.reduceat(lengths, idx)
    return src[idx], dst[idx], merged_len
