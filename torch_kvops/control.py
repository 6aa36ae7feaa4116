"""Side channel for step notices between a producer and a consumer.

Data moves one-sided through the transport; this channel carries the notices about it:
``hello``/``challenge``/``auth``/``welcome`` (mutual authentication, staging grant),
``begin`` (answered: requests the consumer no longer accepts), ``scatter``/``ack``
(staging slots), ``chunk`` (a chunk of a request landed; ``last`` on its final chunk)
and ``failed``. A notice about data is sent strictly after the transport write it
describes returned, and one connection keeps notices in order, so the consumer never
hears "done" before the bytes are there.

Trust: each consumer has a random secret that travels only inside its ``peer_info``
(which the engine hands to the producer over its own channel), or, with a fleet key,
a secret derived from the key and the consumer's engine id (:func:`derived_secret`)
that never travels at all. A connection proves it
knows the secret before anything else it sends is read, and the consumer proves it
too (challenge-response with HMAC-SHA256 over fresh random nonces from both sides, see
:func:`proof`). The secret itself never crosses this channel and is never logged.

Messages are newline-delimited JSON with a size bound; a line over the bound, bad
JSON, a message that is not an object, or anything but the handshake before it
completes drops only that connection. Every socket call has a timeout. A broken
connection is a failed peer, never silently reconnected: notices (and staging acks)
sent on the old connection could otherwise be lost without anyone noticing.
"""
from __future__ import annotations

import hashlib
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

log = logging.getLogger(__name__)

# Before authentication a peer may send two short messages; anything longer is not ours.
MAX_HANDSHAKE_LINE = 4 << 10
# After it, the longest legitimate line is a scatter or begin notice listing block ids.
DEFAULT_MAX_LINE = 16 << 20
# Connections that have not authenticated yet, at once; more are closed on accept.
MAX_PENDING_HANDSHAKES = 64
_NONCE_BYTES = 32


def new_secret() -> str:
    """A fresh consumer secret (256 random bits, hex)."""
    return secrets.token_hex(32)


def derived_secret(fleet_key: bytes, engine_id: str) -> str:
    """The control secret of consumer ``engine_id`` under a fleet key (256 bits, hex):
    every producer holding the key derives it, so it never has to travel."""
    if len(fleet_key) < 32:
        raise ValueError("the fleet key must hold at least 32 bytes")
    return hmac.new(fleet_key, b"kvops-control|" + engine_id.encode(), hashlib.sha256).hexdigest()


def proof(secret: str, role: str, own_nonce: str, other_nonce: str, producer: str) -> str:
    """HMAC-SHA256 that ``role`` ("consumer" or "producer") knows ``secret``.

    The role is part of the message, so a consumer's answer can never be replayed as a
    producer's (reflection), and both nonces are, so an answer recorded on one
    connection is worthless on the next. The producer id is bound too: the id a
    session claims is the id that proved itself."""
    message = "\n".join(("kvops-control-v2", role, own_nonce, other_nonce, producer)).encode()
    return hmac.new(bytes.fromhex(secret), message, hashlib.sha256).hexdigest()


def _check_secret(secret: str) -> str:
    try:
        raw = bytes.fromhex(secret)
    except (TypeError, ValueError) as exc:
        raise ValueError("the control secret must be a hex string (new_secret())") from exc
    if len(raw) < 16:
        raise ValueError("the control secret must hold at least 128 random bits")
    return secret


class ProtocolError(ValueError):
    """A peer broke the control protocol; only its connection is dropped."""


def _no_delay(sock: socket.socket) -> None:
    """Send each notice at once. With Nagle's algorithm a multi-segment message (a
    ``begin`` listing a few thousand block ids) waits for the peer's delayed ACK: 40 ms
    per step on Linux loopback, measured as a third of a 4-layer step."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


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

    @property
    def authenticated(self) -> bool:
        return self.producer is not None

    def reply(self, message: dict) -> None:
        self._server._send(self._conn, message)


class ControlServer:
    """Consumer side: a thread that accepts producers, authenticates them, and hands
    each later message to ``on_message(message, session)``; the first one is a
    ``hello`` (``{"op": "hello", "producer": id, "staging": bool}``) that the handler
    answers with ``welcome``. ``on_close(session)`` runs when an authenticated
    connection ends; ``on_tick`` runs every ``tick_s`` (lease expiry). A message whose
    handler raises drops only its own connection (the producer then fails its requests).

    ``counters`` (read with :meth:`counters_snapshot`) count connections refused by the
    handshake and connections dropped for a bad message."""

    def __init__(self, host: str, on_message: Callable[[dict, Session], None],
                 on_close: Callable[[Session], None], on_tick: Callable[[], None], *,
                 secret: str, tick_s: float = 0.05, send_timeout_s: float = 5.0,
                 handshake_timeout_s: Optional[float] = None,
                 max_line_bytes: int = DEFAULT_MAX_LINE,
                 tls: Optional[ssl.SSLContext] = None) -> None:
        self._on_message, self._on_close, self._on_tick = on_message, on_close, on_tick
        self._tls = tls  # a server context: every connection is TLS (tls.TlsFiles)
        self._secret = _check_secret(secret)
        self._tick_s, self._send_timeout_s = tick_s, send_timeout_s
        self.handshake_timeout_s = send_timeout_s if handshake_timeout_s is None else handshake_timeout_s
        if max_line_bytes < MAX_HANDSHAKE_LINE:
            raise ValueError(f"max_line_bytes must be at least {MAX_HANDSHAKE_LINE}")
        self._max_line = int(max_line_bytes)
        self._counter_lock = threading.Lock()
        self.counters = dict(control_auth_failed=0, control_dropped=0, control_refused_busy=0)
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

    def _count(self, name: str) -> None:
        with self._counter_lock:
            self.counters[name] += 1

    def counters_snapshot(self) -> Dict[str, int]:
        with self._counter_lock:
            return dict(self.counters)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=self._tick_s):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._read(key.fileobj)
                self._expire_handshakes()
                self._on_tick()
        except BaseException as exc:  # surfaced by check(); the thread must not die silently
            log.exception("control server failed")
            self._error = exc

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
        _no_delay(conn)
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
            self._drop(conn)
            return
        session.buffer += data
        limit = self._max_line if session.authenticated else MAX_HANDSHAKE_LINE
        while conn in self._sessions:
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
            if any(s.producer == session._claimed for s in self._sessions.values()):
                raise ProtocolError(f"producer {session._claimed} is already connected")
            session.producer = session._claimed
            self._on_message({"op": "hello", "producer": session.producer, "staging": session.staging},
                             session)
        else:
            raise ProtocolError(f"{op!r} before the handshake completed")

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
        self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()


class ControlClient:
    """Producer side: one connection to a consumer's control server."""

    def __init__(self, address: str, *, timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.05, max_line_bytes: int = DEFAULT_MAX_LINE,
                 tls: Optional[ssl.SSLContext] = None) -> None:
        host, sep, port = str(address).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"control address {address!r} is not 'host:port'")
        self._target = (host, int(port))
        self._timeout_s = timeout_s
        self._retries = retries
        self._backoff_s = backoff_s
        self._max_line = int(max_line_bytes)
        self._tls = tls  # a client context: verifies the consumer's certificate and name
        self._sock: Optional[socket.socket] = None
        self._inbox = bytearray()
        self._lock = threading.Lock()

    def connect(self) -> None:
        """Connect with bounded retries; ``ConnectionError`` at the end."""
        last: Optional[BaseException] = None
        with self._lock:
            for attempt in range(self._retries + 1):
                try:
                    sock = socket.create_connection(self._target, timeout=self._timeout_s)
                    _no_delay(sock)
                    if self._tls is not None:
                        try:
                            sock = self._tls.wrap_socket(sock, server_hostname=self._target[0])
                        except BaseException:
                            sock.close()
                            raise
                    self._sock = sock
                    return
                except ssl.SSLCertVerificationError as exc:  # retrying will not help
                    raise ConnectionError(f"control channel to {self._target[0]}:{self._target[1]}: "
                                          f"TLS certificate refused: {exc}") from exc
                except OSError as exc:
                    last = exc
                    if attempt < self._retries:
                        time.sleep(self._backoff_s * (2 ** attempt))
        raise ConnectionError(f"cannot connect to {self._target[0]}:{self._target[1]} after "
                              f"{self._retries + 1} attempts: {last}") from last

    def handshake(self, secret: str, producer: str, staging: bool) -> dict:
        """Prove that we know the consumer's ``secret`` and check that the consumer
        does (mutual). Returns the ``welcome`` message; ``ConnectionError`` (and the
        connection closed) if the consumer fails to prove itself or refuses us."""
        _check_secret(secret)
        try:
            nonce = secrets.token_hex(_NONCE_BYTES)
            self.send({"op": "hello", "producer": producer, "nonce": nonce, "staging": bool(staging)})
            challenge = self.receive(self._timeout_s)
            if challenge is None or challenge.get("op") != "challenge":
                raise ConnectionError("the consumer did not answer hello")
            their_nonce = str(challenge.get("nonce", ""))
            expected = proof(secret, "consumer", their_nonce, nonce, producer)
            if len(their_nonce) != 2 * _NONCE_BYTES or not hmac.compare_digest(
                    expected, str(challenge.get("proof", ""))):
                raise ConnectionError("the consumer could not prove it knows the secret in its "
                                      "peer_info: not the consumer that peer_info describes")
            self.send({"op": "auth", "proof": proof(secret, "producer", nonce, their_nonce, producer)})
            welcome = self.receive(self._timeout_s)
            if welcome is None or welcome.get("op") != "welcome":
                raise ConnectionError("the consumer refused the handshake (wrong secret in peer_info, "
                                      "or this producer id is connected already)")
            return welcome
        except (ConnectionError, ValueError) as exc:
            self.close()
            raise ConnectionError(f"control handshake with {self._target[0]}:{self._target[1]} "
                                  f"failed: {exc}") from exc

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
        the peer closed the connection or broke the protocol (over-long line, bad JSON)."""
        with self._lock:
            if self._sock is None:
                raise ConnectionError("control channel is closed")
            deadline = time.monotonic() + timeout_s
            while b"\n" not in self._inbox:
                if len(self._inbox) > self._max_line:
                    self._close_locked()
                    raise ConnectionError(f"the peer sent a line longer than {self._max_line} bytes")
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
            try:
                message = json.loads(line)
            except ValueError as exc:
                self._close_locked()
                raise ConnectionError(f"the peer sent a malformed control message: {exc}") from exc
            if not isinstance(message, dict):
                self._close_locked()
                raise ConnectionError("the peer sent a control message that is not a JSON object")
        return message

    def peer_closed(self) -> bool:
        """True when the consumer closed the connection (for example it died): lets the
        sender fail that peer at once instead of waiting for a transfer timeout."""
        with self._lock:
            if self._sock is None:
                return True
            self._sock.settimeout(0.0)  # a timeout-mode socket would wait out its timeout
            try:
                if isinstance(self._sock, ssl.SSLSocket):  # no MSG_PEEK under TLS: keep what came
                    data = self._sock.recv(1 << 16)
                    self._inbox += data
                    return data == b""
                return self._sock.recv(1, socket.MSG_PEEK) == b""
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
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
