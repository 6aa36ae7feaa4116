"""The consumer's integrity verifier thread (integrity.py, docs/connector.md)."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Optional

import numpy as np

from .integrity import DIGEST_BYTES, BlockDigester
from .ledger import ConnectorStats

log = logging.getLogger(__name__)


class Verifier:
    """A thread that recomputes the digests of each layer as its notice arrives, off
    the control thread (which keeps acknowledging other producers' staging slots
    meanwhile), and hands a request's outcome to ``on_done(req_id, entry, problem)``:
    at its first mismatching layer, or (None) at its final job, queued once its last
    chunk landed, behind all its layers."""

    def __init__(self, on_done, stats: ConnectorStats) -> None:
        self._on_done, self._stats = on_done, stats
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="kvops-verifier", daemon=True)
        self._thread.start()

    def submit_layer(self, req_id: str, entry, digester: BlockDigester, layer: int,
                     blocks: np.ndarray, expected: bytes) -> None:
        self._queue.put((req_id, entry, (digester, layer, blocks, expected)))

    def submit_final(self, req_id: str, entry) -> None:
        self._queue.put((req_id, entry, None))

    def _main(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            req_id, entry, layer_job = job
            if entry.ended:
                continue
            if layer_job is None:
                self._on_done(req_id, entry, None)
                continue
            try:
                problem = self._verify(*layer_job)
            except Exception as exc:  # the request fails; the thread goes on
                log.exception("verifying request %s failed", req_id)
                problem = f"verification failed: {exc}"
            if problem is not None:
                self._on_done(req_id, entry, problem)

    def _verify(self, digester: BlockDigester, layer: int, blocks: np.ndarray,
                expected: bytes) -> Optional[str]:
        t0 = time.perf_counter()
        actual = digester.layer_digests(layer, blocks)
        self._stats.add(integrity_us=int((time.perf_counter() - t0) * 1e6))
        if actual == expected:
            return None
        n = DIGEST_BYTES
        bad = [int(b) for k, b in enumerate(blocks)
               if actual[k * n:(k + 1) * n] != expected[k * n:(k + 1) * n]]
        return (f"layer {layer}: {len(bad)} of {len(blocks)} blocks differ from what the producer "
                f"pushed (first: block {bad[0]}, {digester.mode})")

    def close(self, timeout: float) -> bool:
        """Stop after the queued jobs; True if the thread ended in time."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()
