"""Turning a ``write()``'s descriptors into the pieces Mooncake is given.

Validate (sizes agree, no negative length, every source range inside one region this
transport registered: Mooncake's TCP transport would otherwise read whatever the
pointer points at), drop zero-length descriptors, merge descriptors whose source and
destination ranges are both adjacent and whose sources lie in one registered region,
and cut what is larger than the piece size, so that one large write spreads over
Mooncake's parallel TCP connections and reports progress.

Each piece carries the start of its registered source region (the region a write pins
while the piece is in flight). A handful of descriptors is prepared in plain Python;
many with numpy, whose per-call cost (~20 us) only pays off then. Both paths give the
same result.
"""
from __future__ import annotations

import bisect
from typing import List, Sequence, Tuple

import numpy as np

from ..base import TransportError
from .regions import RegionIndex

__all__ = ["Pieces", "prepare", "prepare_numpy", "prepare_small"]

# (source addresses, destination addresses, lengths, source region starts), one entry per piece
Pieces = Tuple[List[int], List[int], List[int], List[int]]


def prepare(peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
            index: RegionIndex, *, merge: bool, piece_bytes: int, small: int) -> Pieces:
    """The pieces of one write; up to ``small`` descriptors go the plain-Python way.
    Raises a permanent TransportError naming ``peer`` for invalid descriptors."""
    sized = all(hasattr(x, "__len__") for x in (src, dst, lengths))
    if sized and len(src) == len(dst) == len(lengths) <= small:
        return prepare_small(peer, src, dst, lengths, index, merge=merge, piece_bytes=piece_bytes)
    return prepare_numpy(peer, src, dst, lengths, index, merge=merge, piece_bytes=piece_bytes)


def prepare_numpy(peer: str, src, dst, lengths, index: RegionIndex, *, merge: bool,
                  piece_bytes: int) -> Pieces:
    """:func:`prepare` with numpy (descriptors as sequences or arrays)."""
    try:
        s = np.asarray(src, dtype=np.uint64).reshape(-1)
        d = np.asarray(dst, dtype=np.uint64).reshape(-1)
        n = np.asarray(lengths, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TransportError(f"invalid descriptors: {exc}", transient=False, peer=peer) from exc
    if not (s.size == d.size == n.size):
        raise TransportError(f"src, dst and lengths differ in size ({s.size}, {d.size}, "
                             f"{n.size})", transient=False, peer=peer)
    if n.size and int(n.min()) < 0:
        raise TransportError("negative length in descriptors", transient=False, peer=peer)
    keep = n > 0
    if not keep.all():
        s, d, n = s[keep], d[keep], n[keep]
    length = n.astype(np.uint64)
    if s.size == 0:
        return [], [], [], []
    if s.size > 1 and merge:
        order = np.argsort(s, kind="stable")
        s, d, length = s[order], d[order], length[order]
    idx = np.searchsorted(index.starts, s, side="right").astype(np.int64) - 1
    bad = idx < 0
    if not bad.any():
        bad = s + length > index.ends[idx]
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise TransportError(f"source range [{int(s[k]):#x}, +{int(length[k])}) is not inside a "
                             f"region registered with this transport ({int(bad.sum())} of "
                             f"{s.size} descriptors)", transient=False, peer=peer)
    region = index.starts[idx]
    if s.size > 1 and merge:
        cont = ((s[:-1] + length[:-1] == s[1:]) & (d[:-1] + length[:-1] == d[1:])
                & (region[:-1] == region[1:]))
        if cont.any():
            heads = np.flatnonzero(np.concatenate(([True], ~cont)))
            length = np.add.reduceat(length, heads)
            s, d, region = s[heads], d[heads], region[heads]
    cap = np.uint64(piece_bytes)
    if int(length.max()) > piece_bytes:
        pieces = (length + cap - np.uint64(1)) // cap
        owner = np.repeat(np.arange(s.size), pieces.astype(np.int64))
        first = np.repeat(np.cumsum(pieces) - pieces, pieces.astype(np.int64))
        offset = (np.arange(owner.size, dtype=np.uint64) - first) * cap
        s, d, region = s[owner] + offset, d[owner] + offset, region[owner]
        length = np.minimum(length[owner] - offset, cap)
    return s.tolist(), d.tolist(), length.tolist(), region.tolist()


def prepare_small(peer: str, src, dst, lengths, index: RegionIndex, *, merge: bool,
                  piece_bytes: int) -> Pieces:
    """:func:`prepare` in plain Python (descriptors as sized sequences of equal length)."""
    try:
        items = [(int(a), int(b), int(c)) for a, b, c in zip(src, dst, lengths, strict=True)]
    except (TypeError, ValueError, OverflowError) as exc:
        raise TransportError(f"invalid descriptors: {exc}", transient=False, peer=peer) from exc
    for a, b, c in items:
        if c < 0:
            raise TransportError("negative length in descriptors", transient=False, peer=peer)
        if a < 0 or b < 0 or a + c >= 1 << 64 or b + c >= 1 << 64:
            raise TransportError(f"invalid descriptor ({a}, {b}, {c})", transient=False,
                                 peer=peer)
    items = [x for x in items if x[2] > 0]
    merge = merge and len(items) > 1
    if merge:
        items.sort(key=lambda x: x[0])
    starts, ends = index.starts_list, index.ends_list
    s_out: List[int] = []
    d_out: List[int] = []
    n_out: List[int] = []
    r_out: List[int] = []
    bad = 0
    first_bad = None
    for a, b, c in items:
        i = bisect.bisect_right(starts, a) - 1
        if i < 0 or a + c > ends[i]:
            bad += 1
            first_bad = first_bad or (a, c)
            continue
        r = starts[i]
        if (merge and s_out and s_out[-1] + n_out[-1] == a and d_out[-1] + n_out[-1] == b
                and r_out[-1] == r):
            n_out[-1] += c
        else:
            s_out.append(a)
            d_out.append(b)
            n_out.append(c)
            r_out.append(r)
    if bad:
        raise TransportError(f"source range [{first_bad[0]:#x}, +{first_bad[1]}) is not inside a "
                             f"region registered with this transport ({bad} of {len(items)} "
                             "descriptors)", transient=False, peer=peer)
    cap = piece_bytes
    if n_out and max(n_out) > cap:
        s2, d2, n2, r2 = [], [], [], []
        for a, b, c, r in zip(s_out, d_out, n_out, r_out):
            for off in range(0, c, cap):
                s2.append(a + off)
                d2.append(b + off)
                n2.append(min(cap, c - off))
                r2.append(r)
        return s2, d2, n2, r2
    return s_out, d_out, n_out, r_out
