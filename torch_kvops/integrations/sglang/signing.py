"""The backend's own ZMQ messages, signed with the fleet key.

SGLang's ZMQ sockets take whatever reaches them. The backend's messages name where P
pushes a room's KV (a decode rank's registration and each room's destination pages)
and what D decodes from (the metadata row: the first output token), or renew D's
leases (the rooms P owes). With a fleet key every such message carries one more
frame: HMAC-SHA256, under a key derived from the fleet key, over its frames (each
length-prefixed, so frames cannot be re-cut); the receiver refuses a message without
it or with a wrong one. SGLang's own abort notice (sent by SGLang's receiver, not by
this backend) stays unsigned: a forged one can only abort the room it names.

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
