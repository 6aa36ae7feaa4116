"""Side channel for completion and failure notices (producer -> consumer).

Data moves one-sided through the transport; this channel only says "request R: chunk
landed / last chunk landed / failed". A notice is sent strictly after the transport
write it describes has returned, so the consumer never hears "done" before the bytes
are there. Messages are newline-delimited JSON and idempotent, so a resend after a
reconnect is harmless. Every socket operation has a timeout.
"""
from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from typing import Callable, Dict, Optional

log = logging.getLogger(__name__)


Reply = Callable[[dict], None]


class ControlServer:
    """Consumer side: a thread that accepts producers and hands each message to
    ``on_message(message, reply)``, where ``reply`` answers on the same connection;
    ``on_tick`` runs every ``tick_s`` (lease expiry)."""

    def __init__(self, host: str, on_message: Callable[[dict, Reply], None],
                 on_tick: Callable[[], None], tick_s: float = 0.05,
                 send_timeout_s: float = 5.0) -> None:
        self._send_timeout_s = send_timeout_s
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._buffers: Dict[socket.socket, bytearray] = {}
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="kvops-control-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=self._tick_s):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read(key.fileobj)
                self._on_tick()
        except BaseException as exc:  # surfaced by check(); the thread must not die silently
            log.exception("control server failed")
            self._error = exc

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        self._buffers[conn] = bytearray()
        self._selector.register(conn, selectors.EVENT_READ, None)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        buf = self._buffers[conn]
        buf += data
        while conn in self._buffers:
            end = buf.find(b"\n")
            if end < 0:
                break
            line = bytes(buf[:end])
            del buf[:end + 1]
            try:
                message = json.loads(line)
            except ValueError:
                log.warning("dropping a malformed control message: %r", line[:200])
                continue
            self._on_message(message, lambda answer, c=conn: self._send(c, answer))

    def _send(self, conn: socket.socket, message: dict) -> None:
        if conn not in self._buffers:
            return  # dropped already
        conn.settimeout(self._send_timeout_s)
        try:
            conn.sendall((json.dumps(message) + "\n").encode())
        except OSError as exc:
            # The producer went away; its requests fail by their leases, the server lives on.
            log.warning("dropping control connection: reply failed: %s", exc)
            self._drop(conn)
            return
        conn.setblocking(False)

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        self._buffers.pop(conn, None)
        conn.close()

    def check(self) -> None:
        """Re-raise an error that stopped the server thread."""
        if self._error is not None:
            raise RuntimeError("the control server thread failed") from self._error

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("control server thread did not stop")
        for conn in list(self._buffers):
            self._drop(conn)
        self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()


class ControlClient:
    """Producer side: one connection to a consumer's control server."""

    def __init__(self, address: str, *, timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.05) -> None:
        host, port = address.rsplit(":", 1)
        self._target = (host, int(port))
        self._timeout_s = timeout_s
        self._retries = retries
        self._backoff_s = backoff_s
        self._sock: Optional[socket.socket] = None
        self._inbox = bytearray()
        self._lock = threading.Lock()

    def connect(self) -> None:
        with self._lock:
            self._connect_locked()

    def _connect_locked(self) -> None:
        if self._sock is None:
            self._sock = socket.create_connection(self._target, timeout=self._timeout_s)

    def send(self, message: dict) -> None:
        """Send with bounded retries (reconnecting); raises ``ConnectionError`` at the end."""
        payload = (json.dumps(message) + "\n").encode()
        last: Optional[BaseException] = None
        with self._lock:
            for attempt in range(self._retries + 1):
                try:
                    self._connect_locked()
                    self._sock.sendall(payload)
                    return
                except OSError as exc:
                    last = exc
                    self._close_locked()
                    if attempt < self._retries:
                        time.sleep(self._backoff_s * (2 ** attempt))
        raise ConnectionError(f"control channel to {self._target[0]}:{self._target[1]} failed after "
                              f"{self._retries + 1} attempts: {last}") from last

    def request(self, message: dict) -> dict:
        """Send ``message`` and wait (bounded) for the next message from the peer."""
        self.send(message)
        answer = self.receive(self._timeout_s)
        if answer is None:
            raise ConnectionError(f"no answer from {self._target[0]}:{self._target[1]} within "
                                  f"{self._timeout_s} s")
        return answer

    def receive(self, timeout_s: float) -> Optional[dict]:
        """Next message from the peer, or None after ``timeout_s``; ConnectionError if
        the peer closed the connection."""
        with self._lock:
            if self._sock is None:
                raise ConnectionError("control channel is not connected")
            deadline = time.monotonic() + timeout_s
            while b"\n" not in self._inbox:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._sock.settimeout(remaining)
                try:
                    data = self._sock.recv(1 << 16)
                except socket.timeout:
                    return None
                except OSError as exc:
                    raise ConnectionError(f"control channel failed: {exc}") from exc
                finally:
                    self._sock.settimeout(self._timeout_s)
                if not data:
                    raise ConnectionError("the peer closed the control channel")
                self._inbox += data
            end = self._inbox.index(b"\n")
            line = bytes(self._inbox[:end])
            del self._inbox[:end + 1]
        return json.loads(line)

    def peer_closed(self) -> bool:
        """True when the consumer closed the connection (for example it died): lets the
        sender fail that peer at once instead of waiting for a transfer timeout."""
        with self._lock:
            if self._sock is None:
                return False
            self._sock.settimeout(0.0)  # a timeout-mode socket would wait out its timeout
            try:
                return self._sock.recv(1, socket.MSG_PEEK) == b""
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return True
            finally:
                self._sock.settimeout(self._timeout_s)

    def _close_locked(self) -> None:
        self._inbox.clear()
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()
