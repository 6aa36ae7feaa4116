"""A room's transfers: one per decode rank that room goes to (with MLA and fewer
prefill ranks than decode ranks, one prefill rank pushes the whole latent to each; with
MHA, each prefill rank its heads to each decode rank that holds them: :mod:`.heads`),
each under a connector id of its own that both sides derive."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ...heads import PartPlan
from ...plan import TransferRequest
from .heads import RankHeads, page_tokens
from .swa_pool import window_firsts, window_transfer
from .windows import SlidingWindows


def transfer_id(room: int, decode_session: str) -> str:
    """The connector's id of ``room``'s transfer to the decode rank whose connector
    engine id is ``decode_session``."""
    return f"{room}@{decode_session}"


def room_of(transfer: str) -> int:
    return int(transfer.partition("@")[0])


@dataclass(frozen=True)
class Destination:
    """One decode rank's destination of one room."""

    peer: str  # the connector's peer id of that decode rank
    endpoint: str  # its ZMQ socket
    pages: np.ndarray  # its page ids for the room, in token order
    aux_index: int
    session: str  # that rank's connector engine id
    heads: Optional[RankHeads] = None  # MHA by head: this prefill rank's heads (else by page)
    part: Optional[PartPlan] = None  # MHA by head: the heads it sends that decode rank
    windowed: bool = False  # to a rank that reads windows only: sliding layers' windows only
    window: Optional[np.ndarray] = None  # its hybrid pool's window pages (block ids), if any
    sliding: range = range(0)  # this rank's sliding buffers of a hybrid pool (swa_pool.py)

    def transfer(self, room: int) -> str:
        if self.part is None:
            return transfer_id(room, self.session)
        return self.heads.part(room, self.session, self.part.decode_rank)

    @property
    def has_window(self) -> bool:
        """Whether its hybrid pool holds a window of the room (swa_pool.py)."""
        return self.window is not None and len(self.window) > 0

    def transfers(self, room: int) -> List[str]:
        """Every transfer of the room to this rank: its pages, and its window."""
        transfer = self.transfer(room)
        return [transfer] + ([window_transfer(transfer)] if self.has_window else [])

    def window_request(self, room: int, src: Sequence[int]) -> Optional[TransferRequest]:
        """The transfer of the prefill's window pages ``src`` (block ids) into this
        rank's, None where it holds no window; ValueError when the two windows differ
        in length (the sides disagree on the room's tokens)."""
        if not self.has_window:
            return None
        if len(src) != len(self.window):
            raise ValueError(f"the prefill's window of room {room} is {len(src)} pages, decode rank "
                             f"{self.session}'s {len(self.window)}")
        return TransferRequest(window_transfer(self.transfer(room)), self.peer, list(src), self.window.tolist(),
                               layer_first_block=window_firsts(self.sliding.start, len(src)))

    def request(self, room: int, src_pages: Sequence[int], dst: slice, last: bool,
                windows: Optional[SlidingWindows] = None) -> TransferRequest:
        """The transfer of ``src_pages`` into this destination's pages ``dst``: whole
        pages (MLA, or MHA by page), or the part's heads of each of their tokens (MHA by
        head); of a sliding layer, those of its window's pages only where ``windowed``."""
        dst_pages = self.pages[dst]
        src, firsts = list(src_pages), None
        if windows is not None and self.windowed and len(dst_pages):
            dropped, firsts = windows.cut(len(self.pages), dst.indices(len(self.pages))[0],
                                          len(dst_pages))
            src, dst_pages = src[dropped:], dst_pages[dropped:]
        if self.sliding:  # a hybrid pool's sliding buffers move the window only (window_request)
            firsts = {**(firsts or {}), **dict.fromkeys(self.sliding, len(src))}
        if self.part is None:
            return TransferRequest(self.transfer(room), self.peer, src, dst_pages.tolist(),
                                   last_chunk=last, layer_first_block=firsts or None)
        # by head: a page's units are its tokens' heads of this part, token by token
        size = self.heads.page_size
        per_page = size * len(self.part.heads)
        src, dst_units = self.part.units(page_tokens(src, size), page_tokens(dst_pages, size))
        return TransferRequest(self.transfer(room), self.peer, src, dst_units, last_chunk=last,
                               layer_first_block={b: f * per_page for b, f in (firsts or {}).items()} or None)


def unit_mismatch(heads: Optional[RankHeads], theirs: Optional[dict]) -> str:
    """What is wrong when a decode rank registered ``theirs`` heads (None: it moves MHA
    KV by page) and this prefill rank moves by ``heads`` (None: by page), or ""."""
    if (heads is None) == (theirs is None):
        return ""
    mine, other = ("page", "head") if heads is None else ("head", "page")
    return (f"moves MHA KV by {other}, this prefill server by {mine}: "
            "set the same mha_unit on every server of the fleet")


def destination(heads: Optional[RankHeads], theirs: Optional[dict], peer: str, endpoint: str,
                pages: np.ndarray, aux_index: int, session: str,
                windows_only: bool = False, window: Optional[np.ndarray] = None,
                sliding: range = range(0)) -> Optional[Destination]:
    """Prefill: a decode rank's destination of a room. ``heads``: this rank's (None:
    moved by page); ``theirs``: the heads the decode rank registered with (None: by
    page); ``windows_only``: whether it registered as reading a sliding layer's window
    only (windows.py; else every page of every layer is pushed). None where a replica
    on a lower prefill rank sends that rank's heads (replicated KV heads). ``window``:
    its hybrid pool's window pages (swa_pool.py), by page only; ``sliding``: this
    rank's sliding buffers of a hybrid pool."""
    mismatch = unit_mismatch(heads, theirs)
    if mismatch:
        raise ValueError(f"decode rank {session} {mismatch}")
    if heads is None:
        return Destination(peer, endpoint, pages, aux_index, session, windowed=windows_only, window=window,
                           sliding=sliding)
    if window is not None:
        raise ValueError(f"decode rank {session} sent a hybrid pool's window, moved by page only")
    if not isinstance(theirs, dict) or theirs.get("total") != heads.total:
        raise ValueError(f"decode rank {session} holds KV heads {theirs}; this model has {heads.total}")
    part = heads.plan_to(int(theirs["tp_size"]), int(theirs["rank"]))
    return None if part is None else Destination(peer, endpoint, pages, aux_index, session, heads, part,
                                                 windowed=windows_only)


def pushed_bytes(requests: Sequence[TransferRequest], caches: Sequence[torch.Tensor]) -> int:
    """The bytes ``requests`` move: of each KV buffer (``caches``: ``[units, unit
    bytes]``, a unit a page, or with MHA by head a head of a token), the units from
    the layer's first on."""
    unit_bytes = [cache.size(1) for cache in caches]
    total = sum(len(r.src_blocks) for r in requests) * sum(unit_bytes)
    return total - sum(first * unit_bytes[buffer] for r in requests if r.layer_first_block
                       for buffer, first in r.layer_first_block.items())


def room_parts(heads: Optional[RankHeads], room: int, session: str, pages: Sequence[int],
               prefill_tp: int) -> Dict[str, List[int]]:
    """Decode: per transfer of ``room`` to this rank (engine id ``session``), the units
    it may write: whole pages (MLA, or MHA by page), or per prefill rank of attention TP
    ``prefill_tp`` that sends heads here, those heads of the pages' tokens (MHA by head)."""
    if heads is None:
        return {transfer_id(room, session): np.asarray(pages, dtype=np.int64).tolist()}
    return heads.expected(room, session, pages, prefill_tp)
