"""Closing the producer's links off the engine's thread (issue 58).

Closing a link unregisters its staging buffer, and the transport waits for that until no
transfer reads the buffer: a write that timed out may leave one running in a Mooncake
lane for up to 30 s (docs/mooncake-notes.md). The engine lets links go between steps
(``release_peers``, from vLLM's ``bind_connector_metadata`` and SGLang's forward hook),
and a wait there would stall the engine; a raise there would end it. So
:class:`LinkReleaser` closes them on a thread of its own. A link whose buffer is still
read is kept, buffer and all, and closed again later: freeing memory Mooncake may still
read would hand it another allocation's bytes.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, List, Optional

from ..transports.base import TransportError
from .ledger import ConnectorStats

if TYPE_CHECKING:
    from .peer import PeerLink

log = logging.getLogger(__name__)

RETRY_S = 1.0  # a link whose buffer is still read is closed again this much later


class LinkReleaser:
    """A thread that closes the links handed to :meth:`release`, retrying a transient
    failure until it succeeds; started on first use, stopped by :meth:`close`."""

    def __init__(self, stats: ConnectorStats) -> None:
        self._stats = stats
        self._cond = threading.Condition()
        self._queue: List[tuple] = []  # (not before, link)
        self._closing: Optional["PeerLink"] = None  # the link being closed now
        self._stop = False
        self._thread: Optional[threading.Thread] = None

    def release(self, link: "PeerLink") -> None:
        """Any thread: close ``link`` soon; never waits."""
        with self._cond:
            if self._stop:
                raise RuntimeError("the connector is closed")
            self._queue.append((0.0, link))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvops-link-release", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every link handed over is closed (or kept for a retry past
        ``timeout``); True if none is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._closing is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
            return True

    def close(self, timeout: float) -> List[str]:
        """Close what is left (each once more, now), stop the thread; the problems."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        problems = []
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                problems.append("the link release thread did not stop within the close timeout")
        with self._cond:
            left, self._queue = [link for _, link in self._queue], []
        return problems + close_links(left)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._due_locked():
                    wake = min((at for at, _ in self._queue), default=time.monotonic() + 1.0)
                    self._cond.wait(max(0.0, wake - time.monotonic()))
                if self._stop:
                    return  # close() closes what is left
                index = self._due_locked()[0]
                _, self._closing = self._queue.pop(index)
                link = self._closing
            retry = False
            try:
                link.close()
            except TransportError as exc:
                retry = exc.transient  # its buffer is still read: kept, closed again later
                if not retry:
                    self._failed(link, exc)
            except (OSError, RuntimeError) as exc:
                self._failed(link, exc)
            with self._cond:
                self._closing = None
                if retry:
                    self._stats.add(link_release_retries=1)
                    self._queue.append((time.monotonic() + RETRY_S, link))
                self._cond.notify_all()

    def _due_locked(self) -> List[int]:
        now = time.monotonic()
        return [i for i, (at, _) in enumerate(self._queue) if at <= now]

    def _failed(self, link: "PeerLink", exc: BaseException) -> None:
        self._stats.add(link_release_failed=1)
        log.warning("peer %s: closing its link failed: %s", link.peer_id, exc)


def close_links(links: List["PeerLink"]) -> List[str]:
    """Close each link now, on this thread (the connector's close); the problems met
    (every link is tried)."""
    problems = []
    for link in links:
        try:
            link.close()
        except (OSError, RuntimeError) as exc:
            problems.append(f"release of peer {link.peer_id} failed: {exc}")
    return problems
