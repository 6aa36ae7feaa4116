"""Consumer side of the control channel: a thread that accepts producers, runs the
handshake and hands each later message to the connector (one ``Session`` per producer)."""
from __future__ import annotations

import collections
import hmac
import json
import logging
import secrets
import selectors
import socket
import ssl
import threading
import time
from typing import Callable, Dict, Optional

from .protocol import (_NONCE_BYTES, DEFAULT_MAX_LINE, MAX_HANDSHAKE_LINE, MAX_PENDING_HANDSHAKES,
                       ProtocolError, _check_secret, _tune, proof)

log = logging.getLogger(__name__)


class Session:
    """One producer connection on the consumer side. ``producer`` is the id the peer
    proved itself as; it is None until the handshake completed."""

    def __init__(self, server: "ControlServer", conn: socket.socket) -> None:
        self._server, self._conn = server, conn
        self.buffer = bytearray()
        self.producer: Optional[str] = None
        self.staging = False  # the producer asked for a staging grant
        self._nonce: Optional[str] = None  # ours, once the challenge is sent
        self._their_nonce = ""
        self._claimed: Optional[str] = None  # the id given in hello, not yet proven
        self.deadline = time.monotonic() + server.handshake_timeout_s
        self.tls_handshaking = False  # TLS handshake not done yet (a TLS server only)
        self.outbox = bytearray()  # answers not yet taken by the producer's socket
        self.stalled_since: Optional[float] = None  # the socket is full: since its last progress
        self.held = 0  # work of its own running off the thread: its next messages wait
        self.closed_by_peer = False  # while held: its messages are handled, then it is dropped

    @property
    def authenticated(self) -> bool:
        return self.producer is not None

    def reply(self, message: dict) -> None:
        self._server._send(self._conn, message)

    def hold(self) -> None:
        """Server thread: hand no more of this session's messages to ``on_message``
        until :meth:`resume` (its order is kept while its work runs elsewhere)."""
        self.held += 1

    def resume(self) -> None:
        """Server thread: the work that held the session is done; its waiting
        messages are handled now, in order."""
        self.held -= 1
        self._server._dispatch(self._conn)

    def drop(self, reason: str) -> None:
        """Server thread: end this connection (its producer then fails its requests)."""
        conn = self._conn
        if conn in self._server._sessions:
            self._server._reject(conn, self, reason)


class ControlServer:
    """Consumer side: a thread that accepts producers, authenticates them, and hands
    each later message to ``on_message(message, session)``; the first one is a
    ``hello`` (``{"op": "hello", "producer": id, "staging": bool}``) that the handler
    answers with ``welcome``. ``on_close(session)`` runs when an authenticated
    connection ends; ``on_tick`` runs every ``tick_s`` (lease expiry). A message whose
    handler raises drops only its own connection (the producer then fails its requests).
    Other threads hand results back with :meth:`call_soon`; a handler that passes a
    session's work to another thread holds the session (``Session.hold``) meanwhile.

    ``counters`` (read with :meth:`counters_snapshot`) count connections refused by the
    handshake and connections dropped for a bad message.

    Answers never block the thread: each session has an outbox that the thread drains
    as its socket takes bytes, so a producer that stops reading delays only its own
    answers; it is dropped once they went unread for ``send_timeout_s`` or its outbox
    outgrows ``max_outbox_bytes``."""

    def __init__(self, host: str, on_message: Callable[[dict, Session], None],
                 on_close: Callable[[Session], None], on_tick: Callable[[], None], *,
                 secret: str, tick_s: float = 0.05, send_timeout_s: float = 5.0,
                 handshake_timeout_s: Optional[float] = None,
                 max_line_bytes: int = DEFAULT_MAX_LINE, max_outbox_bytes: int = 16 << 20,
                 tls: Optional[ssl.SSLContext] = None) -> None:
        self._on_message, self._on_close, self._on_tick = on_message, on_close, on_tick
        self._tls = tls  # a server context: every connection is TLS (tls.TlsFiles)
        self._secret = _check_secret(secret)
        self._tick_s, self._send_timeout_s = tick_s, send_timeout_s
        self.handshake_timeout_s = send_timeout_s if handshake_timeout_s is None else handshake_timeout_s
        if max_line_bytes < MAX_HANDSHAKE_LINE:
            raise ValueError(f"max_line_bytes must be at least {MAX_HANDSHAKE_LINE}")
        self._max_line = int(max_line_bytes)
        self._max_outbox = int(max_outbox_bytes)
        self._counter_lock = threading.Lock()
        self.counters = dict(control_auth_failed=0, control_dropped=0, control_refused_busy=0,
                             control_replaced=0)
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._sessions: Dict[socket.socket, Session] = {}
        self._calls = _Calls()
        self._selector.register(self._calls.wakes, selectors.EVENT_READ, "wake")
        self._stop = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="kvops-control-server", daemon=True)
        self._thread.start()

    def _count(self, name: str) -> None:
        with self._counter_lock:
            self.counters[name] += 1

    def counters_snapshot(self) -> Dict[str, int]:
        with self._counter_lock:
            return dict(self.counters)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, events in self._selector.select(timeout=self._tick_s):
                    if key.fileobj is self._listener:
                        self._accept()
                        continue
                    if key.data == "wake":
                        self._calls.take_wakes()  # what was posted runs below
                        continue
                    if events & selectors.EVENT_WRITE:
                        self._flush(key.fileobj)
                    if events & selectors.EVENT_READ and key.fileobj in self._sessions:
                        self._read(key.fileobj)
                self._calls.run()
                self._expire_handshakes()
                self._expire_unread()
                self._on_tick()
        except BaseException as exc:  # surfaced by check(); the thread must not die silently
            log.exception("control server failed")
            self._error = exc

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Any thread: run ``fn`` on the server thread, soon (dropped once closed)."""
        self._calls.post(fn)

    def _accept(self) -> None:
        try:
            conn, peer = self._listener.accept()
        except BlockingIOError:
            return
        pending = sum(1 for s in self._sessions.values() if not s.authenticated)
        if pending >= MAX_PENDING_HANDSHAKES:
            log.warning("refusing control connection from %s: %d handshakes pending", peer, pending)
            self._count("control_refused_busy")
            conn.close()
            return
        conn.setblocking(False)
        _tune(conn)
        if self._tls is not None:
            try:
                conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            except (ssl.SSLError, OSError) as exc:
                log.warning("control connection from %s: TLS set-up failed: %s", peer, exc)
                self._count("control_auth_failed")
                conn.close()
                return
        session = self._sessions[conn] = Session(self, conn)
        session.tls_handshaking = self._tls is not None
        self._selector.register(conn, selectors.EVENT_READ, None)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        late = [c for c, s in self._sessions.items() if not s.authenticated and s.deadline < now]
        for conn in late:
            log.warning("control connection did not authenticate within %.1f s: closing",
                        self.handshake_timeout_s)
            self._count("control_auth_failed")
            self._drop(conn)

    def _read(self, conn: socket.socket) -> None:
        session = self._sessions[conn]
        if session.tls_handshaking:
            try:
                conn.do_handshake()
                session.tls_handshaking = False
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return  # more handshake bytes to come (bounded by the handshake deadline)
            except (ssl.SSLError, OSError) as exc:
                log.warning("control connection: TLS handshake refused: %s", exc)
                self._count("control_auth_failed")
                self._drop(conn)
                return
        try:
            data = conn.recv(1 << 16)
            if self._tls is not None:
                while conn.pending():  # decrypted bytes the selector will not report
                    data += conn.recv(conn.pending())
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:
            if not session.authenticated:  # left without proving itself
                self._count("control_auth_failed")
            if session.held:  # what it sent before it closed is handled first
                session.closed_by_peer = True
                self._selector.unregister(conn)
                return
            self._drop(conn)
            return
        session.buffer += data
        if session.held and len(session.buffer) > self._max_outbox:
            self._reject(conn, session, f"more than {self._max_outbox} bytes sent while its work ran")
            return
        self._dispatch(conn)

    def _dispatch(self, conn: socket.socket) -> None:
        """Hand the session's complete lines to the handlers, unless it is held."""
        session = self._sessions.get(conn)
        if session is None:
            return
        limit = self._max_line if session.authenticated else MAX_HANDSHAKE_LINE
        while conn in self._sessions and not session.held:
            end = session.buffer.find(b"\n")
            if end < 0:
                if len(session.buffer) > limit:
                    self._reject(conn, session, f"a line longer than {limit} bytes")
                break
            if end > limit:
                self._reject(conn, session, f"a line longer than {limit} bytes")
                break
            line = bytes(session.buffer[:end])
            del session.buffer[:end + 1]
            try:
                message = json.loads(line)
                if not isinstance(message, dict):
                    raise ProtocolError(f"a control message must be a JSON object, got {type(message).__name__}")
                if session.authenticated:
                    self._on_message(message, session)
                else:
                    self._handshake(message, session)
            except Exception as exc:
                log.warning("bad control message %r: dropping the connection (%s: %s)",
                            line[:200], type(exc).__name__, exc)
                self._reject(conn, session, None)
        if session.closed_by_peer and not session.held and conn in self._sessions:
            self._drop(conn)

    def _reject(self, conn: socket.socket, session: Session, reason: Optional[str]) -> None:
        if reason:
            log.warning("dropping control connection (producer %s): %s", session.producer, reason)
        self._count("control_dropped" if session.authenticated else "control_auth_failed")
        self._drop(conn)

    def _handshake(self, message: dict, session: Session) -> None:
        """hello -> challenge (our nonce and our proof) -> auth (theirs) -> on_message(hello)."""
        op = message.get("op")
        if op == "hello" and session._nonce is None:
            claimed, their_nonce = message.get("producer"), message.get("nonce")
            if not isinstance(claimed, str) or not claimed or len(claimed) > 128:
                raise ProtocolError("hello: bad producer id")
            if not isinstance(their_nonce, str) or len(their_nonce) != 2 * _NONCE_BYTES:
                raise ProtocolError("hello: bad nonce")
            session._claimed, session.staging = claimed, bool(message.get("staging"))
            session._nonce = secrets.token_hex(_NONCE_BYTES)
            session._their_nonce = their_nonce
            session.reply({"op": "challenge", "nonce": session._nonce,
                           "proof": proof(self._secret, "consumer", session._nonce, their_nonce, claimed)})
        elif op == "auth" and session._nonce is not None:
            expected = proof(self._secret, "producer", session._their_nonce, session._nonce, session._claimed)
            if not hmac.compare_digest(expected, str(message.get("proof", ""))):
                raise ProtocolError("auth: wrong proof (the producer does not know this consumer's secret)")
            # The same producer again (it proved the secret): its old connection is
            # half-open or broken on its side. The new one replaces it; what the old
            # one began fails there (under the fence: on_close).
            stale = [c for c, s in self._sessions.items() if s.producer == session._claimed]
            for conn in stale:
                log.warning("producer %s connected again: its old control connection is closed",
                            session._claimed)
                self._count("control_replaced")
                self._drop(conn)
            session.producer = session._claimed
            self._on_message({"op": "hello", "producer": session.producer, "staging": session.staging},
                             session)
        else:
            raise ProtocolError(f"{op!r} before the handshake completed")

    def _send(self, conn: socket.socket, message: dict) -> None:
        session = self._sessions.get(conn)
        if session is None or session.closed_by_peer:
            return  # dropped already, or no one reads
        session.outbox += (json.dumps(message) + "\n").encode()
        if len(session.outbox) > self._max_outbox:
            self._reject(conn, session, f"more than {self._max_outbox} bytes of answers unread")
            return
        self._flush(conn)

    def _flush(self, conn: socket.socket) -> None:
        """Hand the session's outbox to its socket, as much as it takes now; while
        bytes are left, the selector also waits for the socket to be writable."""
        session = self._sessions.get(conn)
        if session is None:
            return
        sent = 0
        try:
            while sent < len(session.outbox):
                sent += conn.send(memoryview(session.outbox)[sent:])
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            pass  # full: the rest when the socket is writable again
        except OSError as exc:
            # A producer that closed after its last notice: its acks have no reader.
            level = logging.INFO if isinstance(exc, (ConnectionResetError, BrokenPipeError)) else logging.WARNING
            log.log(level, "dropping control connection: reply failed: %s", exc)
            self._drop(conn)
            return
        del session.outbox[:sent]  # once per flush: no quadratic copying of a long outbox
        was_stalled = session.stalled_since is not None
        if not session.outbox:
            session.stalled_since = None
        elif sent or not was_stalled:
            session.stalled_since = time.monotonic()
        if was_stalled != (session.stalled_since is not None):
            self._selector.modify(conn, selectors.EVENT_READ | (selectors.EVENT_WRITE if session.outbox else 0))

    def _expire_unread(self) -> None:
        """Drop the producers that left their answers unread for ``send_timeout_s``."""
        now = time.monotonic()
        for conn, session in list(self._sessions.items()):
            if session.stalled_since is not None and now - session.stalled_since > self._send_timeout_s:
                self._reject(conn, session, f"answers unread for {self._send_timeout_s:.1f} s")

    def _drop(self, conn: socket.socket) -> None:
        session = self._sessions.pop(conn, None)
        if session is None or not session.closed_by_peer:
            self._selector.unregister(conn)
        conn.close()
        if session is not None:
            session.buffer = bytearray()
            if session.authenticated:
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
        self._selector.unregister(self._calls.wakes)
        self._calls.close()
        self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()


class _Calls:
    """Callables handed to the server thread by others, and the socket that wakes its
    ``select`` when one is posted. At most one wake byte is ever pending (``_woken``),
    so the socket pair's buffer never fills and reading it never finds it empty."""

    def __init__(self) -> None:
        self._queue: "collections.deque[Callable[[], None]]" = collections.deque()
        self._post_end, self.wakes = socket.socketpair()
        for end in (self._post_end, self.wakes):
            end.setblocking(False)
        self._lock = threading.Lock()  # post against take_wakes and close
        self._woken = False  # a wake byte is pending in the pair
        self._closed = False

    def post(self, fn: Callable[[], None]) -> None:
        """Any thread. After close nothing runs any more: ``fn`` is dropped by design
        (a scatter worker that finishes after the server stopped)."""
        with self._lock:
            if self._closed:
                return
            self._queue.append(fn)
            if not self._woken:
                self._woken = True
                self._post_end.send(b"w")

    def take_wakes(self) -> None:
        """Server thread, when ``wakes`` is readable: take the one pending byte. A post
        meanwhile sends none (still woken), and its call runs in the ``run`` that
        follows."""
        with self._lock:
            self.wakes.recv(1)
            self._woken = False

    def run(self) -> None:
        """Server thread: run what was posted."""
        while self._queue:
            self._queue.popleft()()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._post_end.close()
            self.wakes.close()

