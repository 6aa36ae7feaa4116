"""Side channel for step notices between a producer and a consumer.

Data moves one-sided through the transport; this channel carries the notices about it:
``hello``/``welcome`` (staging grant), ``begin`` (answered: requests the consumer no
longer accepts), ``scatter``/``ack`` (staging slots), ``chunk`` (a chunk of a request
landed; ``last`` on its final chunk) and ``failed``. A notice about data is sent
strictly after the transport write it describes returned, and one connection keeps
notices in order, so the consumer never hears "done" before the bytes are there.

Messages are newline-delimited JSON. Every socket call has a timeout. A broken
connection is a failed peer, never silently reconnected: notices (and staging acks)
sent on the old connection could otherwise be lost without anyone noticing.
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


class Session:
    """One producer connection on the consumer side."""

    def __init__(self, server: "ControlServer", conn: socket.socket) -> None:
        self._server, self._conn = server, conn
        self.buffer = bytearray()
        self.producer: Optional[str] = None  # set by the hello handler

    def reply(self, message: dict) -> None:
        self._server._send(self._conn, message)


class ControlServer:
    """Consumer side: a thread that accepts producers and hands each message to
    ``on_message(message, session)``; ``on_close(session)`` runs when a connection
    ends; ``on_tick`` runs every ``tick_s`` (lease expiry). A message whose handler
    raises drops only its own connection (the producer then fails its requests)."""

    def __init__(self, host: str, on_message: Callable[[dict, Session], None],
                 on_close: Callable[[Session], None], on_tick: Callable[[], None],
                 tick_s: float = 0.05, send_timeout_s: float = 5.0) -> None:
        self._on_message, self._on_close, self._on_tick = on_message, on_close, on_tick
        self._tick_s, self._send_timeout_s = tick_s, send_timeout_s
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._sessions: Dict[socket.socket, Session] = {}
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
        self._sessions[conn] = Session(self, conn)
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
        session = self._sessions[conn]
        session.buffer += data
        while conn in self._sessions:
            end = session.buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(session.buffer[:end])
            del session.buffer[:end + 1]
            try:
                self._on_message(json.loads(line), session)
            except Exception:
                log.exception("bad control message %r: dropping the connection", line[:200])
                self._drop(conn)

    def _send(self, conn: socket.socket, message: dict) -> None:
        if conn not in self._sessions:
            return  # dropped already
        conn.settimeout(self._send_timeout_s)
        try:
            conn.sendall((json.dumps(message) + "\n").encode())
        except OSError as exc:
            # A producer that closed after its last notice: its acks have no reader.
            level = logging.INFO if isinstance(exc, (ConnectionResetError, BrokenPipeError)) else logging.WARNING
            log.log(level, "dropping control connection: reply failed: %s", exc)
            self._drop(conn)
            return
        conn.setblocking(False)

    def _drop(self, conn: socket.socket) -> None:
        session = self._sessions.pop(conn, None)
        self._selector.unregister(conn)
        conn.close()
        if session is not None:
            self._on_close(session)

    def check(self) -> None:
        """Re-raise an error that stopped the server thread."""
        if self._error is not None:
            raise RuntimeError("the control server thread failed") from self._error

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("control server thread did not stop")
        for conn in list(self._sessions):
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
        """Connect with bounded retries; ``ConnectionError`` at the end."""
        last: Optional[BaseException] = None
        with self._lock:
            for attempt in range(self._retries + 1):
                try:
                    self._sock = socket.create_connection(self._target, timeout=self._timeout_s)
                    return
                except OSError as exc:
                    last = exc
                    if attempt < self._retries:
                        time.sleep(self._backoff_s * (2 ** attempt))
        raise ConnectionError(f"cannot connect to {self._target[0]}:{self._target[1]} after "
                              f"{self._retries + 1} attempts: {last}") from last

    def send(self, message: dict) -> None:
        """Send one message; ``ConnectionError`` if the connection is broken."""
        payload = (json.dumps(message) + "\n").encode()
        with self._lock:
            if self._sock is None:
                raise ConnectionError("control channel is closed")
            try:
                self._sock.sendall(payload)
            except OSError as exc:
                self._close_locked()
                raise ConnectionError(f"control channel to {self._target[0]}:{self._target[1]} "
                                      f"failed: {exc}") from exc

    def receive(self, timeout_s: float) -> Optional[dict]:
        """Next message from the peer, or None after ``timeout_s``; ConnectionError if
        the peer closed the connection."""
        with self._lock:
            if self._sock is None:
                raise ConnectionError("control channel is closed")
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
                    self._close_locked()
                    raise ConnectionError(f"control channel failed: {exc}") from exc
                finally:
                    if self._sock is not None:
                        self._sock.settimeout(self._timeout_s)
                if not data:
                    self._close_locked()
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
                return True
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
