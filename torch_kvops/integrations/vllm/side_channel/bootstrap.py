"""P's bootstrap endpoint: ``GET /query`` answered as vLLM's MooncakeConnector does.

vllm-router (``--kv-connector mooncake``) and vLLM's mooncake proxy poll
``GET http://<P host>:<bootstrap port>/query`` before they serve, and read
``{dp_rank: {"engine_id": ..., "worker_addr": {tp_rank: {pp_rank: addr}}}}``
(vLLM's ``MooncakeBootstrapServer.query``). We answer the same shape, the side-channel
address in place of the ZMQ worker addresses, and our own facts under ``"kvops"``
(``side_channel``, ``prefill_tp``, ``auth``, ``tls``). A decode engine given
``remote_bootstrap_addr`` and ``remote_engine_id`` reads that rank's side channel there.

Data parallelism (one ``vllm serve --data-parallel-size N``): DP rank 0 serves the
endpoint; every other rank registers its entry with ``POST /register`` (dp_rank.py), as
vLLM's MooncakeConnector workers do, so ``/query`` lists every rank. A registration is
taken only from this host (the connection's source address is the endpoint's own, or
loopback) and, with a fleet key, only signed with it.

Public facts only: no secret is ever in the answer. Slow clients cannot hold it: one
asyncio loop serves every connection (an idle or trickling one costs a socket, not a
thread), a request must arrive whole within ``timeout_s`` (the header deadline) and be
answered within ``total_s``, and at most ``max_clients`` connections are open at once
(more are closed at accept, counted). A legitimate ``GET /query`` is answered at once
beside hundreds of trickling clients, and ``close()`` is bounded.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from typing import Dict, Optional, Tuple

from .auth import AuthError, FleetAuth

log = logging.getLogger(__name__)

BOOTSTRAP_PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
DEFAULT_BOOTSTRAP_PORT = 8998
MAX_REGISTRATION_BYTES = 4 << 10
MAX_HEAD_BYTES = 8 << 10  # request line and headers
MAX_DP_RANKS = 1024
REASONS = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed"}


def bootstrap_address(configured: str, default_host: str) -> Tuple[str, int]:
    """Where P's bootstrap endpoint listens: ``configured`` ("host:port", vLLM's
    ``bootstrap_server_address``), else ``default_host`` and
    ``$VLLM_MOONCAKE_BOOTSTRAP_PORT`` (8998 by default), as vLLM's MooncakeConnector."""
    if configured:
        host, sep, port = configured.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"bootstrap_server_address {configured!r} is not host:port")
        return host.strip("[]"), int(port)
    port = os.environ.get(BOOTSTRAP_PORT_ENV, str(DEFAULT_BOOTSTRAP_PORT))
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"${BOOTSTRAP_PORT_ENV}={port!r} is not a port number")
    return default_host, int(port)


class _Answer:
    """What ``GET /query`` answers: rank 0's entry and the entries other DP ranks
    registered (``POST /register``, checked here)."""

    def __init__(self, entry: dict, auth: Optional[FleetAuth]) -> None:
        self.auth = auth
        self._lock = threading.Lock()
        self._answer = {"0": entry}

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._answer)

    def register(self, message: object) -> None:
        """Take a DP rank's entry (dp_rank.py's message; signed with a fleet key);
        ValueError or AuthError naming what is wrong."""
        if self.auth is not None:
            message, _ = self.auth.open(message, "register")
        if not isinstance(message, dict):
            raise ValueError("a registration is a JSON object")
        rank, entry = message.get("dp_rank"), message.get("entry")
        if type(rank) is not int or not 0 < rank < MAX_DP_RANKS:
            raise ValueError(f"dp_rank must be an integer in [1, {MAX_DP_RANKS}), got {rank!r}")
        ours = self._answer["0"]
        if not isinstance(entry, dict) or set(entry) != set(ours) or \
                not isinstance(entry.get("engine_id"), str) or not isinstance(entry.get("kvops"), dict) or \
                not isinstance(entry["kvops"].get("side_channel"), str):
            raise ValueError("entry must have engine_id, worker_addr and kvops.side_channel as rank 0's")
        with self._lock:
            known = self._answer.get(str(rank))
            self._answer = dict(self._answer, **{str(rank): entry})
        if known != entry:
            log.info("kvops bootstrap: DP rank %d registered (engine %s, side channel %s)", rank,
                     entry["engine_id"], entry["kvops"]["side_channel"])


class _BadRequest(Exception):
    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.status = status


def rank_entry(engine_id: str, side_channel: str, prefill_tp: int, *, signed: bool,
               tls: bool) -> dict:
    """One DP rank's entry in ``GET /query``'s answer."""
    facts: Dict[str, object] = {"side_channel": side_channel, "prefill_tp": int(prefill_tp),
                                "auth": "hmac-sha256" if signed else "none", "tls": bool(tls)}
    return {"engine_id": engine_id,
            "worker_addr": {str(rank): {"0": side_channel} for rank in range(prefill_tp)},
            "kvops": facts}


class BootstrapServer:
    """P's ``GET /query`` endpoint (see the module docstring); ``.address`` is
    "host:port", ``url`` what a decode engine takes as ``remote_bootstrap_addr``."""

    def __init__(self, host: str, port: int, entry: dict, *, auth: Optional[FleetAuth],
                 timeout_s: float = 2.0, total_s: float = 5.0, max_clients: int = 1024) -> None:
        """``entry``: this rank's (:func:`rank_entry`); other DP ranks register theirs.
        ``timeout_s``: a request's line, headers and body arrive within it; ``total_s``:
        its answer is written within it too; ``max_clients``: connections open at once.
        Raises OSError if the address cannot be bound."""
        self._answer = _Answer(entry, auth)
        self._timeout_s, self._total_s, self._max_clients = timeout_s, total_s, max_clients
        self._refused = 0
        self._connections: Dict[asyncio.Task, asyncio.StreamWriter] = {}
        self._loop = asyncio.new_event_loop()
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES, backlog=1024))
        except BaseException:
            self._loop.close()
            raise
        bound_port = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{bound_port}"
        self.url = f"http://{self.address}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvops-bootstrap", daemon=True)
        self._thread.start()
        log.info("kvops bootstrap endpoint: GET %s/query", self.url)

    @property
    def refused(self) -> int:
        """Connections closed at accept because ``max_clients`` were open."""
        return self._refused

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self._max_clients:
            self._refused += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        self._connections[task] = writer
        try:
            await asyncio.wait_for(self._answer_one(reader, writer), self._total_s)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, ValueError) as exc:
            log.debug("bootstrap: a connection ended without an answer: %s", type(exc).__name__)
        finally:
            self._connections.pop(task, None)
            writer.transport.abort()  # no lingering close handshake with a slow client

    async def _answer_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read one request (whole within the header deadline) and answer it."""
        try:
            method, path, body = await asyncio.wait_for(self._read(reader), self._timeout_s)
            status, answer = self._route(method, path, body, writer)
        except _BadRequest as exc:
            status, answer = exc.status, {"error": str(exc)}
        data = json.dumps(answer).encode()
        writer.write(f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()

    async def _read(self, reader: asyncio.StreamReader) -> Tuple[str, str, bytes]:
        """(method, path without its query, body) of one request."""
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        parts = head[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "not an HTTP/1.x request line")
        headers = {}
        for line in head[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        body = b""
        if parts[0] == "POST":
            length = headers.get("content-length", "")
            if not length.isdigit() or not 0 < int(length) <= MAX_REGISTRATION_BYTES:
                raise _BadRequest(400, f"a registration is 1-{MAX_REGISTRATION_BYTES} bytes")
            body = await reader.readexactly(int(length))
        return parts[0], parts[1].split("?", 1)[0], body

    def _route(self, method: str, path: str, body: bytes,
               writer: asyncio.StreamWriter) -> Tuple[int, dict]:
        if method == "GET" and path == "/query":
            return 200, self._answer.snapshot()
        if method == "POST" and path == "/register":
            peer, own = writer.get_extra_info("peername")[0], writer.get_extra_info("sockname")[0]
            if peer != own and not peer.startswith("127.") and peer != "::1":
                return 403, {"error": "registrations are taken from this host only"}
            try:
                self._answer.register(json.loads(body))
            except (ValueError, AuthError) as exc:
                log.warning("bootstrap: registration from %s refused: %s", peer, exc)
                return 400, {"error": str(exc)[:200]}
            return 200, {"ok": True}
        if path in ("/query", "/register"):
            return 405, {"error": "GET /query or POST /register"}
        return 404, {"error": "not found: this endpoint serves GET /query (and POST /register)"}

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving: the listener and every open connection closed, the thread joined."""
        if self._loop.is_closed():
            return

        async def stop() -> None:
            self._server.close()
            # each connection ends on its own once its socket is gone (a cancelled
            # task trips asyncio's streams in 3.11: "Exception in callback")
            for writer in list(self._connections.values()):
                writer.transport.abort()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("kvops bootstrap thread did not stop")
        self._loop.close()
