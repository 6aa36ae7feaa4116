"""The handshake ports this host's Mooncake engines drew lately, so that a new engine
does not take the port of an earlier one.

A producer's Mooncake keeps what it learnt of a peer (its segment: registered buffers,
TCP lane port; and its lane connections) under the peer's ``host:handshake_port``, and
cannot drop it from Python (docs/mooncake-notes.md, "A peer restarted at the same
address"). A consumer restarted on the handshake port of an earlier process is written
through the earlier process's segment, and every write to it fails until it restarts
again. Mooncake draws the port at random from 2,000 (15000-16999), so among a few
dozen restarts on one host a repeat is likely: seen twice in 50 restarts
(``python -m torch_kvops.bench.peer_churn``), and the likely cause of a CI failure of
``tests/test_serving_restarts.py`` (a restarted D that received no byte).

:class:`RecentPorts` is a small file, shared by the processes of one user on one host
under an exclusive lock, holding the last ``capacity`` ``host:port`` pairs drawn.
:func:`start_engine` draws again, with the repeated engine kept alive meanwhile so that
the next draw cannot land on it, when a port is in the file. What it cannot cover: an
earlier process of another user, or of a container whose file system did not survive
its restart, at the same address.
"""
from __future__ import annotations

import fcntl
import logging
import os
from typing import Optional

__all__ = ["RecentPorts", "default_ports_file"]

log = logging.getLogger(__name__)

CAPACITY = 512  # a quarter of Mooncake's 2,000 ports: the next draw stays easy to satisfy


def default_ports_file() -> str:
    """``$KVOPS_MOONCAKE_PORTS_FILE``, else ``$XDG_CACHE_HOME`` (``~/.cache``)
    ``/torch_kvops/mooncake-handshake-ports``."""
    chosen = os.environ.get("KVOPS_MOONCAKE_PORTS_FILE")
    if chosen:
        return chosen
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_kvops", "mooncake-handshake-ports")


class RecentPorts:
    """The last ``capacity`` addresses (``host:port``) claimed on this host, oldest
    first, one per line of ``path``."""

    def __init__(self, path: Optional[str] = None, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.path = path or default_ports_file()
        self.capacity = int(capacity)

    def claim(self, address: str) -> bool:
        """Record ``address`` and return True, or return False if an engine of this
        host drew it lately (among the last ``capacity``). An unusable file (no
        permission, read-only file system) is logged and the address taken as new:
        the engine starts, as it would without this check."""
        try:
            return self._claim(address)
        except OSError as exc:
            log.warning("cannot use %s to avoid reusing a recent Mooncake handshake port "
                        "(%s): %s is taken without the check", self.path, exc, address)
            return True

    def _claim(self, address: str) -> bool:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+", encoding="ascii", errors="replace") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            recent = [line.strip() for line in f if line.strip()]
            if address in recent:
                return False
            recent = (recent + [address])[-self.capacity:]
            f.seek(0)
            f.truncate()
            f.write("".join(line + "\n" for line in recent))
            return True
