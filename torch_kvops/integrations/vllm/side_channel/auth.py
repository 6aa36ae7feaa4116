"""Fleet key: who may talk on the side channel, and the control channel's secrets.

Every engine of a P/D fleet reads the same key (a file of at least 32 random bytes;
``kv_connector_extra_config["fleet_key_file"]`` or the ``KVOPS_FLEET_KEY_FILE``
environment variable). With it:

- each side-channel message is an envelope ``{"ts", "nonce", "body", "mac"}``: an
  HMAC-SHA256 over the role ("post" or "answer"), a timestamp, a fresh 128-bit nonce
  and the body's exact bytes; an answer also binds the nonce of the post it answers,
  so it is worthless for any other post. The receiver refuses a missing or wrong MAC,
  a timestamp outside ``skew_s`` of its clock, and a nonce it saw within that window;
- a consumer's control-channel secret is derived from the key and the consumer's
  engine id (:func:`control_secret`), so ``peer_info`` carries no secret at all.

The key itself never crosses the wire and is never logged.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections import OrderedDict
from typing import Tuple

from ....control import derived_secret
from ....control.fleet_key import FLEET_KEY_ENV, MIN_KEY_BYTES
from ....tls import TlsFiles, tls_files  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

_NONCE_BYTES = 16
_DOMAIN = b"kvops-side-channel-v1"


class AuthError(ValueError):
    """A message failed authentication; ``cause`` names why (a counter name)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause


def control_secret(fleet_key: bytes, engine_id: str) -> str:
    """The control-channel secret of the consumer ``engine_id`` (hex, 256 bits):
    producers holding the fleet key derive it; nobody else can."""
    return derived_secret(fleet_key, engine_id)


def _mac(key: bytes, role: str, ts: str, nonce: str, reply_to: str, body: str) -> str:
    message = b"\n".join((_DOMAIN, role.encode(), ts.encode(), nonce.encode(), reply_to.encode(),
                          body.encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class FleetAuth:
    """Signs and checks side-channel envelopes under one fleet key.

    ``skew_s`` bounds the clock difference accepted between two engines and how long
    a nonce is remembered; at most ``max_nonces`` are (a flood beyond that is refused
    as ``replay_cache_full`` rather than forgetting nonces still in their window)."""

    def __init__(self, key: bytes, skew_s: float = 30.0, max_nonces: int = 200_000) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the fleet key must hold at least {MIN_KEY_BYTES} bytes")
        if skew_s <= 0:
            raise ValueError(f"auth_skew_s must be positive, got {skew_s}")
        self._key, self.skew_s, self._max_nonces = key, float(skew_s), int(max_nonces)
        self._seen: "OrderedDict[str, float]" = OrderedDict()  # nonce -> forget after (monotonic)
        self._lock = threading.Lock()

    def seal(self, body: dict, role: str, reply_to: str = "") -> Tuple[bytes, str]:
        """(one envelope line, its nonce)."""
        text = json.dumps(body, separators=(",", ":"))
        ts, nonce = repr(time.time()), secrets.token_hex(_NONCE_BYTES)
        envelope = {"ts": ts, "nonce": nonce, "body": text,
                    "mac": _mac(self._key, role, ts, nonce, reply_to, text)}
        return json.dumps(envelope, separators=(",", ":")).encode() + b"\n", nonce

    def open(self, envelope: object, role: str, reply_to: str = "", remember: bool = True
             ) -> Tuple[dict, str]:
        """(the body, the envelope's nonce) of a genuine, fresh, first-seen envelope;
        :class:`AuthError` otherwise. ``remember=False`` skips the replay cache (an
        answer is bound to our own fresh nonce through ``reply_to`` already)."""
        if not isinstance(envelope, dict) or "mac" not in envelope:
            raise AuthError("unsigned", "no MAC (is the fleet key configured on both sides?)")
        ts, nonce, text, mac = (envelope.get(k) for k in ("ts", "nonce", "body", "mac"))
        if not all(isinstance(v, str) for v in (ts, nonce, text, mac)) or len(nonce) != 2 * _NONCE_BYTES:
            raise AuthError("malformed", "envelope fields missing or of the wrong type")
        if not hmac.compare_digest(_mac(self._key, role, ts, nonce, reply_to, text), mac):
            raise AuthError("bad_signature", "MAC does not match (another fleet key?)")
        try:
            age = time.time() - float(ts)
        except ValueError:
            raise AuthError("malformed", "timestamp is not a number") from None
        if abs(age) > self.skew_s:
            raise AuthError("stale", f"timestamp {age:+.1f} s away from ours (window {self.skew_s} s)")
        if remember:
            self._remember(nonce)
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise AuthError("malformed", f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise AuthError("malformed", "body is not an object")
        return body, nonce

    def _remember(self, nonce: str) -> None:
        now = time.monotonic()
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthError("replay", "nonce seen before")
            if len(self._seen) >= self._max_nonces:
                raise AuthError("replay_cache_full", f"{self._max_nonces} nonces in the window")
            # a stale check at +skew and a replay check over 2*skew cover every timestamp
            self._seen[nonce] = now + 2 * self.skew_s


def warn_unauthenticated(what: str) -> None:
    """The start-up warning of an engine without a fleet key."""
    log.warning("kvops: no fleet key (kv_connector_extra_config fleet_key_file or $%s): %s",
                FLEET_KEY_ENV, what)
