"""Producer side of the control channel: one connection to a consumer's control server."""
from __future__ import annotations

import hmac
import json
import secrets
import socket
import ssl
import threading
import time
from typing import Optional

from .protocol import _NONCE_BYTES, DEFAULT_MAX_LINE, _check_secret, _tune, proof


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
                    _tune(sock)
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
                                      "or the consumer closed the connection)")
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
        """Next message from the peer, or None after ``timeout_s`` (0: only what has
        arrived already, without waiting); ConnectionError if the peer closed the
        connection or broke the protocol (over-long line, bad JSON)."""
        with self._lock:
            if self._sock is None:
                raise ConnectionError("control channel is closed")
            deadline = time.monotonic() + timeout_s
            read = False
            while b"\n" not in self._inbox:
                if len(self._inbox) > self._max_line:
                    self._close_locked()
                    raise ConnectionError(f"the peer sent a line longer than {self._max_line} bytes")
                remaining = deadline - time.monotonic()
                if remaining <= 0 and read:
                    return None
                read = True
                self._sock.settimeout(max(remaining, 0.0))  # 0.0: a non-blocking read
                try:
                    data = self._sock.recv(1 << 16)
                except (socket.timeout, BlockingIOError, InterruptedError,
                        ssl.SSLWantReadError, ssl.SSLWantWriteError):
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
