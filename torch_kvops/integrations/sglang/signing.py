"""The backend's own ZMQ messages, signed with the fleet key.

SGLang's ZMQ sockets take whatever reaches them. The backend's messages name where P
pushes a room's KV (a decode rank's registration and each room's destination pages)
and what D decodes from (the metadata row: the first output token), or renew D's
leases (the rooms P owes). With a fleet key every such message carries one more
frame: HMAC-SHA256, under a key derived from the fleet key, over its frames (each
length-prefixed, so frames cannot be re-cut); the receiver refuses a message without
it or with a wrong one. SGLang's own abort notice, which SGLang's receiver sends, is
signed on its way out (:class:`SignedAborts`), so it is refused unsigned as well.

Without a fleet key messages are sent and taken as they are (a loopback-only fleet:
settings.py refuses an exposed one)."""
from __future__ import annotations

import hashlib
import hmac
from typing import List, Optional

_DOMAIN = b"kvops-sglang-zmq-v1"


class MessageSigner:
    """Signs and opens the backend's ZMQ messages (no-ops without a fleet key)."""

    def __init__(self, fleet_key: Optional[bytes]) -> None:
        self._key = None if fleet_key is None else hmac.new(fleet_key, _DOMAIN, hashlib.sha256).digest()

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def sign(self, frames: List[bytes]) -> List[bytes]:
        """``frames`` and, with a fleet key, their MAC as one more frame."""
        return list(frames) if self._key is None else [*frames, self._mac(frames)]

    def open(self, frames: List[bytes]) -> List[bytes]:
        """The frames of a signed message without its MAC; ``ValueError`` if it is not
        signed with the fleet's key."""
        if self._key is None:
            return list(frames)
        if len(frames) < 2 or not hmac.compare_digest(frames[-1], self._mac(frames[:-1])):
            raise ValueError("a message not signed with the fleet key")
        return list(frames[:-1])

    def _mac(self, frames: List[bytes]) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for frame in frames:
            mac.update(len(frame).to_bytes(8, "little"))
            mac.update(bytes(frame))
        return mac.digest()


class SignedAborts:
    """A decode rank's socket to a prefill rank, as SGLang's receiver sends on it
    (conn.py wraps it): SGLang's own abort notice (first frame ``abort_tag``) goes out
    signed, like the backend's messages, so no one without the key can abort a
    prefill's rooms. The backend's messages come here signed already and pass as they
    are."""

    def __init__(self, sock, signer: MessageSigner, abort_tag: bytes) -> None:
        self._sock, self._signer, self._abort_tag = sock, signer, abort_tag

    def send_multipart(self, frames, *args, **kwargs):
        if frames and frames[0] == self._abort_tag:
            frames = self._signer.sign(frames)
        return self._sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)
