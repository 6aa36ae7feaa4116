"""Prefill side of the side channel: receives destinations from decode engines.

One thread runs a selector over the listener and every open connection, so connections
progress concurrently and none waits for another: each has a *total* deadline for its
whole message (``message_timeout_s`` from accept, however the bytes trickle in), a
message is at most ``max_message_bytes``, at most ``max_connections`` are open (a new
one beyond that closes the oldest, which a legitimate poster, done in milliseconds,
never is), and the table holds at most ``capacity`` destinations for ``ttl_s``.

Liveness: D asks ``{"op": "pending", "transfer_ids": [...]}`` every sixth of its lease
and renews the leases of the transfers P answers it still owes: a destination not yet
taken (the request waits in P's queue) or taken and not settled (P is prefilling it
or its pushes are under way). A transfer P settled (its pushes over, or given up on) is
never pending again, and a post for it is refused (``settled``), so D recomputes at
once instead of waiting for its lease.

Every refusal is counted by cause (:meth:`DestinationServer.counters`).
"""
from __future__ import annotations

import json
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from .auth import AuthError, FleetAuth, TlsFiles

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20  # block ids of a very long prompt fit; anything larger is refused
MAX_PROBED = 4096  # transfer ids one liveness question may name
REFUSALS = ("slow", "oversized", "malformed", "unsigned", "bad_signature", "stale", "replay",
            "replay_cache_full", "full", "too_many_connections", "closed_early", "tls_failed",
            "settled", "bound")


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    handshaking: bool = False  # TLS handshake not done yet
    buffer: bytearray = field(default_factory=bytearray)


def parse_destination(msg: dict) -> Tuple[str, dict]:
    """(transfer id, destination) of a post; ValueError/KeyError/TypeError if malformed."""
    tid = msg["transfer_id"]
    if not isinstance(tid, str) or not tid or len(tid) > 512:
        raise ValueError("transfer_id must be a non-empty string of at most 512 characters")
    dest = {"block_ids": [int(b) for b in msg["block_ids"]],
            "start_token": int(msg["start_token"]),
            "peers": [dict(p) for p in msg["peers"]]}
    if not dest["peers"]:
        raise ValueError("no decode peers")
    if dest["start_token"] < 0 or any(b < 0 for b in dest["block_ids"]):
        raise ValueError("negative block id or start_token")
    return tid, dest


class DestinationServer:
    """Prefill side: receives destinations and keeps at most ``capacity`` of them (the
    oldest is dropped, after ``ttl_s`` at the latest) until the scheduler takes them.

    ``auth``: with a :class:`FleetAuth`, only signed, fresh, first-seen posts are
    accepted and answers are signed; without, anyone who reaches the port may post.
    ``tls``: serve TLS (mutual: the client's certificate must chain to the CA)."""

    def __init__(self, host: str, port: int, capacity: int = 4096, ttl_s: float = 300.0,
                 io_timeout_s: float = 2.0, facts: Optional[dict] = None, *,
                 auth: Optional[FleetAuth] = None, tls: Optional[TlsFiles] = None,
                 max_connections: int = 64, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 advertise: Optional[str] = None) -> None:
        self._capacity, self._ttl_s = capacity, ttl_s
        self._message_timeout_s = io_timeout_s  # total, per message
        self._max_connections, self._max_bytes = max_connections, max_message_bytes
        self._facts = dict(facts or {}, ok=True)
        self._accepted = json.dumps(self._facts).encode()
        self._auth = auth
        self._tls = tls.server_context() if tls is not None else None
        self._lock = threading.Lock()
        self._dests: "OrderedDict[str, Tuple[float, dict]]" = OrderedDict()
        # taken by the scheduler and not settled: tid -> forget after (monotonic)
        self._active: "OrderedDict[str, float]" = OrderedDict()
        self._settled: "OrderedDict[str, None]" = OrderedDict()  # the newest ``capacity``
        # tid -> the destination it is bound to (its first accepted post), until settled:
        # a post naming another destination for it is refused (a hijack, or an id two
        # clients chose alike); the same post again (an answer lost, D retried) is not
        self._bound: "OrderedDict[str, str]" = OrderedDict()
        self._counts: Dict[str, int] = dict.fromkeys(("accepted", "probes") + REFUSALS, 0)
        self._conns: "OrderedDict[socket.socket, _Conn]" = OrderedDict()  # oldest first
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._sock = socket.create_server((host, port))
        self._sock.setblocking(False)
        # what decode instances are told: the host's address when bound to every interface
        self.address = f"{advertise or host}:{self._sock.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="kvops-side-channel", daemon=True)
        self._thread.start()
        log.info("kvops side channel listening on %s (%s%s)", self.address,
                 "signed" if auth else "UNAUTHENTICATED", ", TLS" if tls else "")

    # ------------------------------------------------------------------ scheduler thread

    def take(self, transfer_id: str) -> Optional[dict]:
        """The destination posted for ``transfer_id`` (removed), or None."""
        with self._lock:
            self._expire()
            entry = self._dests.pop(transfer_id, None)
            if entry is not None:
                self._active[transfer_id] = time.monotonic() + self._ttl_s
                _trim(self._active, self._capacity)
        return None if entry is None else entry[1]

    def settle(self, transfer_id: str) -> None:
        """The scheduler owes ``transfer_id`` nothing more: the workers reported its
        pushes over, or P gave it up. It is not pending any more, and a (late) post for
        it is refused."""
        with self._lock:
            self._dests.pop(transfer_id, None)
            self._active.pop(transfer_id, None)
            self._bound.pop(transfer_id, None)
            self._settled[transfer_id] = None
            _trim(self._settled, self._capacity)

    def pending(self, transfer_ids) -> list:
        """Of ``transfer_ids``, those P still owes a push: posted and not taken, or
        taken and not settled."""
        now = time.monotonic()
        with self._lock:
            self._expire()
            while self._active and next(iter(self._active.values())) < now:
                self._active.popitem(last=False)
            return [t for t in transfer_ids if t in self._dests or t in self._active]

    def counters(self) -> Dict[str, int]:
        """Cumulative counts: ``accepted`` and one per refusal cause (REFUSALS)."""
        with self._lock:
            return dict(self._counts)

    def check(self) -> None:
        """Re-raise an error that stopped the server thread."""
        if self._error is not None:
            raise RuntimeError("the kvops side-channel thread failed") from self._error

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("kvops side-channel thread did not stop")
        for sock in list(self._conns):
            self._drop(sock)
        self._selector.close()
        self._sock.close()

    # ------------------------------------------------------------------ server thread

    def _count(self, cause: str) -> None:
        with self._lock:
            self._counts[cause] += 1

    def _expire(self) -> None:
        now = time.monotonic()
        while self._dests and next(iter(self._dests.values()))[0] < now:
            tid, _ = self._dests.popitem(last=False)
            self._bound.pop(tid, None)
            log.warning("destination of %s expired unused", tid)

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                timeout = 0.1
                if self._conns:
                    first = next(iter(self._conns.values()))  # earliest deadline: oldest
                    timeout = max(0.0, min(timeout, first.deadline - time.monotonic()))
                for key, _ in self._selector.select(timeout):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj in self._conns:
                        self._read(self._conns[key.fileobj])
                self._expire_slow()
        except BaseException as exc:  # surfaced by check(); never dies silently
            log.exception("kvops side channel failed")
            self._error = exc

    def _accept(self) -> None:
        for _ in range(64):  # drain a burst, then let the connections progress
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: the listener stays, this one is lost
                log.warning("side channel: accept failed: %s", exc)
                return
            if len(self._conns) >= self._max_connections:
                oldest = next(iter(self._conns))
                log.warning("side channel: %d connections open: closing the oldest",
                            self._max_connections)
                self._count("too_many_connections")
                self._drop(oldest)
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + self._message_timeout_s)
            if self._tls is not None:
                try:
                    conn.sock = sock = self._tls.wrap_socket(sock, server_side=True,
                                                             do_handshake_on_connect=False)
                except (ssl.SSLError, OSError) as exc:
                    log.warning("side channel: TLS set-up failed: %s", exc)
                    self._count("tls_failed")
                    sock.close()
                    continue
                conn.handshaking = True
            self._conns[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _expire_slow(self) -> None:
        now = time.monotonic()
        while self._conns:
            sock, conn = next(iter(self._conns.items()))
            if conn.deadline > now:
                return
            log.warning("side channel: no whole message within %.1f s: closing",
                        self._message_timeout_s)
            self._count("slow")
            self._drop(sock)

    def _read(self, conn: _Conn) -> None:
        sock = conn.sock
        if conn.handshaking:
            try:
                sock.do_handshake()
                conn.handshaking = False
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return  # more handshake bytes to come (bounded by the deadline)
            except (ssl.SSLError, OSError) as exc:
                log.warning("side channel: TLS handshake refused: %s", exc)
                self._count("tls_failed")
                self._drop(sock)
                return
        while True:  # drain the kernel's and TLS's buffers
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError as exc:
                log.warning("side channel: connection failed: %s", exc)
                self._count("closed_early")
                self._drop(sock)
                return
            if not data:
                self._count("closed_early")
                self._drop(sock)
                return
            conn.buffer += data
            end = conn.buffer.find(b"\n")
            if end < 0 and len(conn.buffer) <= self._max_bytes:
                continue
            if end < 0 or end > self._max_bytes:
                log.warning("side channel: message over %d bytes: refused", self._max_bytes)
                self._count("oversized")
                self._reply(sock, b"oversized")
            else:
                self._reply(sock, self._handle(bytes(conn.buffer[:end])))
            return

    def _reply(self, sock: socket.socket, answer: bytes) -> None:
        """Answers are short: they fit the socket's send buffer, so a non-blocking
        send completes at once (a client that does not read only loses its answer)."""
        try:
            sock.send(answer + b"\n")
        except (OSError, ssl.SSLError) as exc:
            log.warning("side channel: answer not sent: %s", exc)
        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._conns.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass  # never registered (closed during set-up)
        sock.close()

    def _handle(self, line: bytes) -> bytes:
        reply_to = ""
        try:
            msg = json.loads(line)
            if self._auth is not None:
                msg, reply_to = self._auth.open(msg, "post")
            if not isinstance(msg, dict):
                raise ValueError("not a JSON object")
            if msg.get("op") == "pending":
                return self._answer_pending(msg, reply_to)
            tid, dest = parse_destination(msg)
        except AuthError as exc:
            log.warning("side channel: refused a post: %s", exc)
            self._count(exc.cause)
            return exc.cause.encode()
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("side channel: malformed destination: %s", exc)
            self._count("malformed")
            return self._answer({"ok": False, "error": "bad"}, reply_to, b"bad")
        with self._lock:
            self._expire()
            if tid in self._settled:
                log.warning("side channel: destination of %s arrived after P settled it: refused", tid)
                self._counts["settled"] += 1
                return self._answer({"ok": False, "error": "settled"}, reply_to, b"settled")
            fingerprint = json.dumps(dest, sort_keys=True)
            if self._bound.get(tid, fingerprint) != fingerprint:
                log.warning("side channel: a post for %s names another destination than the one it is "
                            "bound to: refused", tid)
                self._counts["bound"] += 1
                return self._answer({"ok": False, "error": "bound"}, reply_to, b"bound")
            if tid not in self._dests and len(self._dests) >= self._capacity:
                log.error("side channel full (%d destinations): refusing %s", self._capacity, tid)
                self._counts["full"] += 1
                full = True
            else:
                self._dests[tid] = (time.monotonic() + self._ttl_s, dest)
                self._bound[tid] = fingerprint
                self._bound.move_to_end(tid)
                _trim(self._bound, 2 * self._capacity)  # posted and taken ones
                self._counts["accepted"] += 1
                full = False
        if full:
            return self._answer({"ok": False, "error": "full"}, reply_to, b"full")
        log.debug("destination of %s arrived at %.4f", tid, time.monotonic())
        return self._answer(self._facts, reply_to, self._accepted)

    def _answer_pending(self, msg: dict, reply_to: str) -> bytes:
        tids = msg.get("transfer_ids")
        if (not isinstance(tids, list) or len(tids) > MAX_PROBED
                or any(not isinstance(t, str) or len(t) > 512 for t in tids)):
            raise ValueError(f"transfer_ids must be a list of at most {MAX_PROBED} strings")
        self._count("probes")
        body = {"ok": True, "pending": self.pending(tids)}
        return self._answer(body, reply_to, json.dumps(body).encode())

    def _answer(self, body: dict, reply_to: str, plain: bytes) -> bytes:
        if self._auth is None or not reply_to:
            return plain
        return self._auth.seal(body, "answer", reply_to)[0].rstrip(b"\n")


def _trim(table: "OrderedDict", capacity: int) -> None:
    while len(table) > capacity:
        table.popitem(last=False)
