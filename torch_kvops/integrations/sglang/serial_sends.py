"""One send at a time per ZMQ endpoint, the socket's lookup included.

SGLang 0.5.23's ``CommonKVManager._send_multipart_locked`` looks the endpoint's cached
socket up under one lock (``_connect``: a socket whose monitor saw the peer disconnect
is closed there and made anew) and sends on it under another (per endpoint). A thread
that finds the peer gone may so close the socket another thread is sending on, and
libzmq aborts the process (``Assertion failed: pfd.revents & POLLIN``, signaler.cpp):
seen here when a decode server was killed while P's push thread sent a room's metadata
row and its owed-rooms thread sent a notice to the same server. Holding one lock per
endpoint across both steps keeps a socket from closing under a send.
"""
from __future__ import annotations

import threading
from typing import Dict, List


class SerialSends:
    """Mixed in before SGLang's ``CommonKVManager`` (whose method it wraps)."""

    def _send_multipart_locked(self, endpoint: str, parts: List[bytes], is_ipv6: bool = False):
        with _endpoint_lock(self, endpoint):
            return super()._send_multipart_locked(endpoint, parts, is_ipv6)


_LOCKS_GUARD = threading.Lock()


def _endpoint_lock(owner, endpoint: str) -> threading.Lock:
    with _LOCKS_GUARD:
        locks: Dict[str, threading.Lock] = owner.__dict__.setdefault("_kvops_endpoint_locks", {})
        return locks.setdefault(endpoint, threading.Lock())
