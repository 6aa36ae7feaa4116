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

Public facts only: no secret is ever in the answer. Bounded: at most
``max_clients`` requests are served at once (more are closed at accept), each with
``timeout_s`` per socket operation and ``total_s`` in all (a client that trickles its
request a byte at a time is cut off then), so ``close()`` is bounded too.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Optional, Tuple

from .auth import AuthError, FleetAuth

log = logging.getLogger(__name__)

BOOTSTRAP_PORT_ENV = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
DEFAULT_BOOTSTRAP_PORT = 8998
MAX_REGISTRATION_BYTES = 4 << 10
MAX_DP_RANKS = 1024


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


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] != "/query":
            self._send(404, {"error": "not found: this endpoint serves GET /query"})
            return
        self._send(200, self.server.snapshot())

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] != "/register":
            self._send(404, {"error": "not found: POST /register only"})
            return
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > MAX_REGISTRATION_BYTES:
            self._send(400, {"error": f"a registration is 1-{MAX_REGISTRATION_BYTES} bytes"})
            return
        peer, own = self.client_address[0], self.connection.getsockname()[0]
        if peer != own and not peer.startswith("127.") and peer != "::1":
            self._send(403, {"error": "registrations are taken from this host only"})
            return
        try:
            self.server.register(json.loads(self.rfile.read(int(length))))
        except (ValueError, AuthError) as exc:
            log.warning("bootstrap: registration from %s refused: %s", peer, exc)
            self._send(400, {"error": str(exc)[:200]})
            return
        self._send(200, {"ok": True})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        log.debug("bootstrap: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # joined by server_close(): no thread outlives close()
    block_on_close = True

    def __init__(self, address: Tuple[str, int], answer: dict, timeout_s: float, total_s: float,
                 max_clients: int, auth: Optional[FleetAuth]) -> None:
        self.answer, self.timeout_s, self.total_s = answer, timeout_s, total_s
        self.auth = auth
        self._answer_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_clients)
        self.refused = 0
        super().__init__(address, _Handler)

    def snapshot(self) -> dict:
        with self._answer_lock:
            return dict(self.answer)

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
        ours = self.answer["0"]
        if not isinstance(entry, dict) or set(entry) != set(ours) or \
                not isinstance(entry.get("engine_id"), str) or not isinstance(entry.get("kvops"), dict) or \
                not isinstance(entry["kvops"].get("side_channel"), str):
            raise ValueError("entry must have engine_id, worker_addr and kvops.side_channel as rank 0's")
        with self._answer_lock:
            known = self.answer.get(str(rank))
            self.answer = dict(self.answer, **{str(rank): entry})
        if known != entry:
            log.info("kvops bootstrap: DP rank %d registered (engine %s, side channel %s)", rank,
                     entry["engine_id"], entry["kvops"]["side_channel"])

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks our name up in DNS (getfqdn), which can hang
        # where resolution is slow; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        request.settimeout(self.timeout_s)
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        # the whole request within total_s: a watchdog shuts the socket down then,
        # which ends the handler's blocking read
        watchdog = threading.Timer(self.total_s, _cut, args=(request,))
        watchdog.daemon = True
        watchdog.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            watchdog.cancel()
            self._slots.release()


def _cut(request: socket.socket) -> None:
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already: the handler finished just now
        log.debug("bootstrap: the request's socket was closed before its watchdog fired")


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
                 timeout_s: float = 2.0, total_s: float = 30.0, max_clients: int = 16) -> None:
        """``entry``: this rank's (:func:`rank_entry`); other DP ranks register theirs."""
        self._server = _Server((host, port), {"0": entry}, timeout_s, total_s, max_clients, auth)
        self.address = f"{host}:{self._server.server_address[1]}"
        self.url = f"http://{self.address}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="kvops-bootstrap", daemon=True)
        self._thread.start()
        log.info("kvops bootstrap endpoint: GET %s/query", self.url)

    @property
    def refused(self) -> int:
        """Connections closed at accept because ``max_clients`` were being served."""
        return self._server.refused

    def close(self, timeout: float = 5.0) -> None:
        self._server.shutdown()
        self._thread.join(timeout)
        self._server.server_close()  # joins the request threads (each bounded by timeout_s)
        if self._thread.is_alive():
            raise RuntimeError("kvops bootstrap thread did not stop")

