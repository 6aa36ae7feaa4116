"""SGLang's KV pool as the connector sees it: one tensor per buffer (every layer's K,
then every layer's V, as SGLang's ``KVArgs`` lists them), one block per page."""
from __future__ import annotations

import ctypes
from typing import List, Sequence

import torch


def page_views(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int]) -> List[torch.Tensor]:
    """``[pages, page_bytes]`` uint8 views of host buffers SGLang describes by address,
    length and page size in bytes (its pool tensors are not handed to a backend)."""
    if not (len(ptrs) == len(lens) == len(item_lens)) or not ptrs:
        raise ValueError(f"KV buffers: {len(ptrs)} addresses, {len(lens)} lengths, "
                         f"{len(item_lens)} page sizes")
    views = []
    for ptr, length, item in zip(ptrs, lens, item_lens):
        if item <= 0 or length < item:
            raise ValueError(f"a KV buffer of {length} bytes cannot hold pages of {item} bytes")
        pages = length // item
        buffer = (ctypes.c_uint8 * (pages * item)).from_address(int(ptr))
        views.append(torch.frombuffer(buffer, dtype=torch.uint8).view(pages, item))
    return views


def read_rows(ptrs: Sequence[int], item_lens: Sequence[int], row: int) -> List[bytes]:
    """Row ``row`` of each metadata buffer (SGLang's aux data: first token, room...)."""
    return [ctypes.string_at(int(ptr) + item * row, item) for ptr, item in zip(ptrs, item_lens)]


def write_rows(ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int], row: int,
               rows: Sequence[bytes]) -> None:
    """Write one row into each metadata buffer; every size and bound is checked before
    the first byte is written (the rows come from a peer)."""
    if len(rows) != len(ptrs):
        raise ValueError(f"{len(rows)} metadata rows for {len(ptrs)} buffers")
    for length, item, data in zip(lens, item_lens, rows):
        if len(data) != item:
            raise ValueError(f"a metadata row of {len(data)} bytes for rows of {item}")
        if row < 0 or (row + 1) * item > length:
            raise ValueError(f"metadata row {row} is outside a buffer of {length // item} rows")
    for ptr, item, data in zip(ptrs, item_lens, rows):
        ctypes.memmove(int(ptr) + item * row, data, item)
