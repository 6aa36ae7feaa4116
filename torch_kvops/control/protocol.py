"""The control protocol's fixed parts: line bounds, secrets and the handshake proof.

Shared by the consumer's server (server.py) and the producer's client (client.py); see
the package docstring for the protocol and its trust model.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

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


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3


def _tune(sock: socket.socket) -> None:
    """Every control socket, both sides. No delay: send each notice at once (with
    Nagle's algorithm a multi-segment message, a ``begin`` listing a few thousand block
    ids, waits for the peer's delayed ACK: 40 ms per step on Linux loopback, measured as
    a third of a 4-layer step). Keepalive: a peer that vanished without a reset (its
    host lost power, a partition) is found within idle + interval x probes (25 s) even
    on a connection that carries nothing, so its session does not linger."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's defaults
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
