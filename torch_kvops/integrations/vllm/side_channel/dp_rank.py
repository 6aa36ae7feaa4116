"""Data parallelism on a prefill instance (one ``vllm serve --data-parallel-size N``):
each DP rank's scheduler runs its own side channel, on the configured port plus its DP
rank; rank 0 serves the bootstrap endpoint, and every other rank registers its entry
there (``POST /register``, bootstrap.py), as vLLM's MooncakeConnector workers do, so
``GET /query`` lists every rank and a router sends each decode engine the engine id of
the rank that holds its request (``remote_engine_id``, vLLM's ``<engine_id>_dp<rank>``).

A rank registers on a thread that retries with backoff until rank 0 takes it (rank 0
may start later), then again every ``refresh_s`` (rank 0 may have restarted); every
attempt is bounded by ``timeout_s``.
"""
from __future__ import annotations

import http.client
import json
import logging
import threading
from typing import Optional

from .auth import FleetAuth

log = logging.getLogger(__name__)


def side_channel_port(configured: int, dp_rank: int) -> int:
    """The side-channel port of DP rank ``dp_rank``: ``configured`` plus the rank (0,
    a free port, is refused with data parallelism: rank 0 could not name it)."""
    if dp_rank == 0:
        return configured
    if configured == 0:
        raise ValueError("kvops: a prefill instance with data parallelism needs a fixed side_channel_port "
                         "(DP rank r listens on side_channel_port + r), not 0")
    if configured + dp_rank >= 65536:
        raise ValueError(f"kvops: side_channel_port {configured} + DP rank {dp_rank} is not a port")
    return configured + dp_rank


class RankRegistration:
    """DP rank ``dp_rank`` >= 1: keeps its ``entry`` registered with rank 0's bootstrap
    endpoint at ``host:port``."""

    def __init__(self, host: str, port: int, dp_rank: int, entry: dict, auth: Optional[FleetAuth],
                 timeout_s: float = 2.0, refresh_s: float = 30.0) -> None:
        self._where = (host, port)
        self._message = {"dp_rank": dp_rank, "entry": entry}
        self._auth, self._timeout_s, self._refresh_s = auth, timeout_s, refresh_s
        self._stop = threading.Event()
        self.registered = threading.Event()  # rank 0 took the entry at least once
        self._thread = threading.Thread(target=self._run, name=f"kvops-dp{dp_rank}-register", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                self._register_once()
                if not self.registered.is_set():
                    log.info("kvops: DP rank %d registered with the bootstrap endpoint %s:%d",
                             self._message["dp_rank"], *self._where)
                self.registered.set()
                backoff = 0.2
                self._stop.wait(self._refresh_s)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                log.log(logging.WARNING if backoff >= 3.2 else logging.INFO,
                        "kvops: DP rank %d not registered with %s:%d yet: %s",
                        self._message["dp_rank"], *self._where, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _register_once(self) -> None:
        if self._auth is not None:
            body, _ = self._auth.seal(self._message, "register")
        else:
            body = json.dumps(self._message).encode()
        conn = http.client.HTTPConnection(*self._where, timeout=self._timeout_s)
        try:
            conn.request("POST", "/register", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = response.read(4096)
        finally:
            conn.close()
        if response.status != 200:
            raise ValueError(f"answered {response.status}: {answer[:200]!r}")

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("kvops DP registration thread did not stop")
