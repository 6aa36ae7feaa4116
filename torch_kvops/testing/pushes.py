"""A producer step as an engine runs it, for tests: start it, call every layer's hook
(the layers' KV is written already), wait for the pushes."""
from __future__ import annotations

from typing import Sequence

import torch


def push_step(conn, caches: Sequence[torch.Tensor], requests: Sequence, timeout: float = 30.0) -> None:
    """Push ``requests`` (TransferRequests) of one step through producer ``conn``."""
    conn.start_step(list(requests))
    for layer, cache in enumerate(caches):
        conn.save_kv_layer(layer, cache)
    conn.wait_for_save(timeout=timeout)
