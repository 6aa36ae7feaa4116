"""Producer side of the integrity check: each written layer's digests computed on a
worker thread while the peer's lane writes the next layer, and sent to the peer (a
``digests`` notice) by that lane, in layer order, once they are ready.

    lane of a peer: write layer i -> submit(i) -> write layer i+1 -> send_ready() -> ...
    worker:                          digest layer i (GIL released in the hashing) ...

A layer's notice follows its bytes on the wire (its write returned, its staging
scatters were sent before it on the same control channel), so the consumer may verify
the layer as soon as the notice arrives. Everything is sent before the step's chunk
notices (``send_ready(..., wait=True)``), so a request is never reported landed with
digests missing. Each peer's notices are kept apart: a lane sends only its own peer's.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Deque, Dict, Optional, Tuple

import numpy as np

from .integrity import DIGEST_BYTES, BlockDigester
from .ledger import ConnectorStats
from .peer import PeerFailed, PeerLink


class DigestPipeline:
    """One worker thread; jobs are (peer, layer, the step's source blocks per request)."""

    def __init__(self, stats: ConnectorStats) -> None:
        self._stats = stats
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvops-digest")
        # per peer id: (layer, digests) in layer order; each deque is one lane's
        self._pending: Dict[str, Deque[Tuple[int, Future, Dict[str, int]]]] = {}

    def submit(self, peer: PeerLink, layer: int, req_blocks: Dict[str, np.ndarray],
               firsts: Optional[Dict[str, int]] = None) -> None:
        """Digest ``layer`` of each request's source blocks (already written to ``peer``).
        ``firsts``: per request whose layer moved only its blocks from the k-th on
        (``TransferRequest.layer_first_block``), that k, sent with the digests."""
        digester = peer.digester
        assert digester is not None
        job = self._pool.submit(self._digest, digester, layer, req_blocks)
        self._pending.setdefault(peer.peer_id, deque()).append((layer, job, firsts or {}))

    def _digest(self, digester: BlockDigester, layer: int,
                req_blocks: Dict[str, np.ndarray]) -> Dict[str, str]:
        t0 = time.perf_counter()
        # one call over the step's blocks of every request (the native op parallelises it)
        blocks = np.concatenate(list(req_blocks.values()))
        merged = digester.layer_digests(layer, blocks) if blocks.size else b""
        out, at = {}, 0
        for req_id, src in req_blocks.items():
            out[req_id] = merged[at:at + src.size * DIGEST_BYTES].hex()
            at += src.size * DIGEST_BYTES
        self._stats.add(integrity_us=int((time.perf_counter() - t0) * 1e6))
        return out

    def send_ready(self, peer: PeerLink, failed_peers: Dict[str, Optional[str]],
                   wait: bool = False) -> None:
        """Send ``peer``'s notices of the layers digested so far, in order (all of them,
        waiting for the worker, with ``wait``). A failing channel adds the peer to
        ``failed_peers``; a failed peer's notices are dropped."""
        pending = self._pending.get(peer.peer_id)
        while pending and (wait or pending[0][1].done()):
            layer, future, firsts = pending.popleft()
            digests = future.result()  # an exception here is the lane's (reported)
            if peer.peer_id in failed_peers:
                continue
            notice = {"op": "digests", "layer": layer, "mode": peer.digester.mode, "reqs": digests}
            if firsts:
                notice["first"] = firsts
            try:
                peer.send(notice)
            except PeerFailed as exc:
                failed_peers.setdefault(peer.peer_id, str(exc))

    def discard(self, peer_id: Optional[str] = None) -> None:
        """Forget what is pending for ``peer_id``, or for every peer (a lane that ended
        in an exception, or the pipeline closing): waits for the running jobs."""
        for pid in ([peer_id] if peer_id is not None else list(self._pending)):
            pending = self._pending.pop(pid, None)
            while pending:
                pending.popleft()[1].exception()

    def close(self, wait: bool = True) -> None:
        """Stop the worker. ``wait=False`` where the sender thread may still run (it did
        not stop in time): its pending jobs are left to it, and the worker ends after
        the running one."""
        if wait:
            self.discard()
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

