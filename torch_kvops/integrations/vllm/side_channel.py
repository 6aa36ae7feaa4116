"""Decode -> prefill side channel: the decode scheduler posts, for each request it
allocated blocks for, ``{transfer_id, block_ids, start_token, peers}`` (``peers``: the
decode engine's per-rank peer_info) to a small TCP endpoint of the prefill scheduler.

One JSON line per connection, answered with one line: ``{"ok": true, ...}`` carrying
the prefill engine's facts the decode side needs (its tensor-parallel size), or
``full`` / ``bad``.
Every socket call has a timeout; both sides hold bounded state; neither runs in the
engine loop (the server has its own thread, the poster a thread fed by a bounded
queue), so a slow or dead peer never blocks scheduling.
"""
from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional, Tuple

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 << 20  # block ids of a very long prompt fit; anything larger is refused


def _read_line(sock: socket.socket, limit: int) -> bytes:
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("peer closed before a full line")
        data += chunk
        if len(data) > limit:
            raise ValueError(f"message longer than {limit} bytes")
    return bytes(data)


class DestinationServer:
    """Prefill side: receives destinations and keeps at most ``capacity`` of them (the
    oldest is dropped, after ``ttl_s`` at the latest) until the scheduler takes them."""

    def __init__(self, host: str, port: int, capacity: int = 4096, ttl_s: float = 300.0,
                 io_timeout_s: float = 2.0, facts: Optional[dict] = None) -> None:
        self._capacity, self._ttl_s, self._io_timeout_s = capacity, ttl_s, io_timeout_s
        self._accepted = json.dumps(dict(facts or {}, ok=True)).encode()
        self._lock = threading.Lock()
        self._dests: "OrderedDict[str, Tuple[float, dict]]" = OrderedDict()
        self._stop = threading.Event()
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.1)  # accept wakes up to notice close()
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, name="kvops-side-channel", daemon=True)
        self._thread.start()
        log.info("kvops side channel listening on %s", self.address)

    def take(self, transfer_id: str) -> Optional[dict]:
        """The destination posted for ``transfer_id`` (removed), or None."""
        with self._lock:
            self._expire()
            entry = self._dests.pop(transfer_id, None)
        return None if entry is None else entry[1]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._dests and next(iter(self._dests.values()))[0] < now:
            tid, _ = self._dests.popitem(last=False)
            log.warning("destination of %s expired unused", tid)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            with conn:
                conn.settimeout(self._io_timeout_s)
                try:
                    answer = self._handle(_read_line(conn, MAX_MESSAGE_BYTES))
                    conn.sendall(answer + b"\n")
                except (OSError, ValueError, ConnectionError) as exc:
                    # one bad or slow client must not stop the endpoint: it gets no ack
                    # and retries or lets its request fail by lease
                    log.warning("side channel: dropped a message: %s", exc)

    def _handle(self, line: bytes) -> bytes:
        try:
            msg = json.loads(line)
            tid = str(msg["transfer_id"])
            dest = {"block_ids": [int(b) for b in msg["block_ids"]],
                    "start_token": int(msg["start_token"]),
                    "peers": [dict(p) for p in msg["peers"]]}
            if not dest["peers"]:
                raise ValueError("no decode peers")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("side channel: malformed destination: %s", exc)
            return b"bad"
        with self._lock:
            self._expire()
            if tid not in self._dests and len(self._dests) >= self._capacity:
                log.error("side channel full (%d destinations): refusing %s", self._capacity, tid)
                return b"full"
            self._dests[tid] = (time.monotonic() + self._ttl_s, dest)
        log.debug("destination of %s arrived at %.4f", tid, time.monotonic())
        return self._accepted

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._sock.close()
        if self._thread.is_alive():
            raise RuntimeError("kvops side-channel thread did not stop")


class DestinationPoster:
    """Decode side: posts destinations from a bounded queue on its own thread, each
    with ``timeout_s`` per attempt and ``retries`` retries. Every post ends in one call
    of ``on_result(transfer_id, answer)``: the prefill side's answer (a dict), or None
    if it refused or could not be reached (the request then fails on the decode side)."""

    def __init__(self, on_result: Callable[[str, Optional[dict]], None], timeout_s: float = 2.0,
                 retries: int = 2, capacity: int = 1024) -> None:
        self._on_result = on_result
        self._timeout_s, self._retries = timeout_s, retries
        self._queue: "queue.Queue[Tuple[str, dict]]" = queue.Queue(maxsize=capacity)
        self._stop = threading.Event()
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="kvops-poster", daemon=True)
        self._thread.start()

    def post(self, address: str, message: dict) -> bool:
        """Queue a message; False if the queue is full (nothing is sent)."""
        try:
            self._queue.put_nowait((address, message))
            return True
        except queue.Full:
            log.error("destination queue full: %s not posted", message.get("transfer_id"))
            self.failures += 1
            self._on_result(str(message.get("transfer_id")), None)
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                address, message = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self._send(address, message)

    def _send(self, address: str, message: dict) -> None:
        tid = str(message.get("transfer_id"))
        answer = None
        try:
            answer = self._post(address, message)
        finally:
            if answer is None:
                self.failures += 1
            self._on_result(tid, answer)

    def _post(self, address: str, message: dict) -> Optional[dict]:
        host, port = address.rsplit(":", 1)
        payload = json.dumps(message).encode() + b"\n"
        for attempt in range(self._retries + 1):
            if self._stop.is_set():
                return None
            try:
                with socket.create_connection((host, int(port)), timeout=self._timeout_s) as sock:
                    sock.settimeout(self._timeout_s)
                    sock.sendall(payload)
                    answer = _read_line(sock, 4096).strip()
                if answer.startswith(b"{"):
                    reply = json.loads(answer)
                    if isinstance(reply, dict) and reply.get("ok") is True:
                        log.debug("posted %s at %.4f", message.get("transfer_id"), time.monotonic())
                        return reply
                log.error("prefill side at %s refused %s: %s", address,
                          message.get("transfer_id"), answer.decode(errors="replace"))
                return None  # "full" or "bad": retrying the same message will not help
            except (OSError, ConnectionError, ValueError) as exc:
                log.warning("posting %s to %s failed (attempt %d): %s",
                            message.get("transfer_id"), address, attempt + 1, exc)
                time.sleep(0.05 * (2 ** attempt))
        return None

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("kvops poster thread did not stop")
