"""SGLang's hybrid sliding-window pool (its default for gpt-oss, Gemma, Mellum...): the
full-attention layers' KV in one pool, the sliding layers' in a second, smaller one
that holds only each request's last window, with pages of its own. SGLang lists the
first pool's buffers as the KV (``kv_data_ptrs``) and the second's as a state
component (``StateType.SWA``: ``state_data_ptrs``), and names a room's window pages
apart (``state_indices``, last chunk only): on the prefill side the pages from
``max(decode prefix, prompt - window)``, page-aligned, to the prompt's end; on the
decode side its own pages for the same tokens, as many.

The connector registers both pools' buffers, the sliding ones in a block space of
their own (plan.KVLayout.of): a room's full pages and its window are two transfers
of one room to each decode rank, the window's under :func:`window_transfer`, its ids
past the full pool's (``LayerwiseConnector.block_id_base``), and the full layers move
none of it. The window goes in the last chunk's forward (layerwise.py computes its
pages as SGLang will name them), else after it. No SGLang import here.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .pages import page_views

SWA_STATE = "swa"  # StateType.SWA's value (disaggregation/base/conn.py)


def pool_buffers(kv_args) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(the KV buffers, a hybrid pool's sliding buffers or []): ``[pages, page_bytes]``
    views, every layer's K then every layer's V in each."""
    full = page_views(kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens)
    index = _swa_index(kv_args)
    if index is None:
        return full, []
    sliding = page_views(kv_args.state_data_ptrs[index], kv_args.state_data_lens[index],
                         kv_args.state_item_lens[index])
    return full, sliding


def window_pages(kv_args, state_indices, base: int) -> Optional[np.ndarray]:
    """A room's window pages among SGLang's ``state_indices`` (one entry per state
    type) as block ids (``base``: the id of the sliding pool's page 0); None without
    a hybrid pool or without the entry."""
    index = _swa_index(kv_args)
    if index is None or state_indices is None or len(state_indices) <= index or state_indices[index] is None:
        return None
    return np.asarray(state_indices[index], dtype=np.int64).reshape(-1) + base


def window_transfer(transfer: str) -> str:
    """The connector id of a room's window, beside its transfer ``transfer`` of full pages."""
    return f"{transfer}/window"


def window_firsts(full_buffers: int, pages: int) -> Dict[int, int]:
    """``layer_first_block`` of a window of ``pages`` pages: the full layers' buffers
    (the first ``full_buffers``) move none of it."""
    return dict.fromkeys(range(full_buffers), pages)


def window_ids_frame(window: Optional[Sequence[int]]) -> bytes:
    """The decode side's window ids, as its destination message carries them."""
    return b"" if window is None else np.asarray(window, dtype=np.int64).tobytes()


def _swa_index(kv_args) -> Optional[int]:
    types = [getattr(t, "value", t) for t in getattr(kv_args, "state_types", None) or []]
    return types.index(SWA_STATE) if SWA_STATE in types else None
