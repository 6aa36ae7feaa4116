"""A producer step as an engine runs it, for tests: start it, call every layer's hook
(the layers' KV is written already), wait for the pushes."""
from __future__ import annotations

import time
from typing import Dict, List, Sequence

import numpy as np
import torch


def push_step(conn, caches: Sequence[torch.Tensor], requests: Sequence, timeout: float = 30.0,
              partial: bool = False) -> Dict[str, str]:
    """Push ``requests`` (TransferRequests) of one step through producer ``conn``;
    returns the requests ``start_step`` refused (``partial``), with the reasons."""
    refused = conn.start_step(list(requests), partial=partial)
    for layer, cache in enumerate(caches):
        conn.save_kv_layer(layer, cache)
    conn.wait_for_save(timeout=timeout)
    return refused


def producer_outcome(conn, req_id: str, timeout: float = 10.0) -> bool:
    """Poll producer ``conn`` until it reports ``req_id``: True if finished, False if
    failed (AssertionError if neither within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, failed = conn.get_finished()
        if req_id in done | failed:
            return req_id in done
        time.sleep(0.005)
    raise AssertionError(f"{req_id} not reported by the producer within {timeout} s")


def push_and_receive(conn, caches: Sequence[torch.Tensor], consumer, request,
                     timeout: float = 10.0) -> List[np.ndarray]:
    """Push one request in one step to ``consumer`` (a ConsumerProcess), check that the
    consumer reports it finished and that every layer of its destination blocks holds
    the source blocks' bytes; returns the consumer's caches for further checks."""
    push_step(conn, caches, [request])
    finished, failed, _ = consumer.call("wait", [request.req_id], timeout)
    assert finished == {request.req_id} and not failed, (finished, failed)
    received = consumer.call("caches")
    for layer, cache in enumerate(caches):
        assert np.array_equal(received[layer][request.dst_blocks], cache[request.src_blocks].numpy()), \
            f"layer {layer} of {request.req_id} did not land byte-exact"
    return received
