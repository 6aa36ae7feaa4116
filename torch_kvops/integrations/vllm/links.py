"""P's worker side: its links to decode ranks, kept off the forward path.

A link is made the first time a request needs a decode rank, on a connect thread: the
step waits for it at most ``connect_wait_s`` (a healthy decode instance answers in
milliseconds), then goes on without it (that request's part fails and its decode
side recomputes) while the attempt goes on, so a decode instance that drops packets
costs P's steps ``connect_wait_s`` per attempt instead of every timeout and retry of
the connection. Later steps do not wait for an attempt whose wait ended.

A circuit breaker (connector/breaker.py) paces the attempts: a link that failed
(unreachable, a write that failed after its retries, a broken control channel) is
connected again when a request needs it, after a bounded, jittered backoff that
doubles with each failure in a row, and once none of its requests is in flight any
more. Links that failed or idled for ``peer_idle_s`` are released between steps, and
the least recently used beyond ``max_decode_links`` (with nothing in flight).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Dict, Optional, Set, Tuple

from ...connector.breaker import PeerBreaker
from .metadata import KvopsSettings

if TYPE_CHECKING:
    from ...connector import LayerwiseConnector
    from .metrics import StatsCollector

log = logging.getLogger(__name__)

CONNECT_THREADS = 4  # decode instances connected at once


class DecodeLinks:
    """Consumer engine id -> peer id of the producer connector, connected in the
    background (module docstring). Engine thread only, but for the connect threads."""

    def __init__(self, conn: "LayerwiseConnector", settings: KvopsSettings, metrics: "StatsCollector") -> None:
        self._conn, self._settings, self._metrics = conn, settings, metrics
        self._peers: Dict[str, str] = {}
        self._breaker = PeerBreaker()
        self._ever_connected: Set[str] = set()  # a new link to one of these is a reconnect
        self._connecting: Dict[str, Tuple[Future, float]] = {}  # engine id -> (attempt, wait until)
        self._pool: Optional[ThreadPoolExecutor] = None  # made on the first connection
        self._next_release = 0.0
        self._published = (0, 0)  # (live links, links backing off) last counted in metrics

    def peer(self, info: dict) -> Optional[str]:
        """The peer id of a decode rank (its ``peer_info``); None while it cannot be
        used (connecting past its wait, backing off, or its old link still busy).
        ``ValueError`` for a peer_info the connector refuses."""
        try:
            return self._peer(info)
        finally:
            self._publish()

    def _publish(self) -> None:
        """Links live and backing off, as changes (the gauges
        ``vllm:kvops_decode_links`` and ``vllm:kvops_decode_links_backing_off``)."""
        now = (len(self._peers), len(self._breaker))
        if now != self._published:
            self._metrics.count("links_change", now[0] - self._published[0])
            self._metrics.count("links_backing_off_change", now[1] - self._published[1])
            self._published = now

    def _peer(self, info: dict) -> Optional[str]:
        engine_id = info["engine_id"]
        peer = self._peers.get(engine_id)
        if peer is not None:
            reason = self._conn.peer_failed(peer)
            if reason is None:
                return peer
            self._breaker.failed(engine_id, reason)  # the link broke: reconnect later
            self._metrics.count("peer_link_broken")
            del self._peers[engine_id]
        attempt = self._connecting.get(engine_id)
        if attempt is None:
            if not self._breaker.may_try(engine_id):
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(CONNECT_THREADS, thread_name_prefix="kvops-connect")
            # bounded by control_timeout_s and retries
            attempt = (self._pool.submit(self._conn.add_peer, info),
                       time.monotonic() + self._settings.connect_wait_s)
            self._connecting[engine_id] = attempt
        future, wait_until = attempt
        if not wait([future], timeout=max(0.0, wait_until - time.monotonic())).done:
            self._metrics.count("peer_connect_pending")
            return None
        del self._connecting[engine_id]
        try:
            peer = future.result()
        except RuntimeError as exc:  # its old link still has requests in flight
            log.info("decode instance %s: not connected again yet: %s", engine_id, exc)
            return None
        except (ConnectionError, OSError) as exc:
            log.error("decode instance %s unreachable, its requests fail: %s", engine_id, exc)
            self._breaker.failed(engine_id, str(exc))
            return None
        if engine_id in self._ever_connected:
            self._metrics.count("peer_reconnected")
        if len(self._ever_connected) > 4096:  # bounded while D instances come and go
            self._ever_connected.clear()
        self._ever_connected.add(engine_id)
        self._breaker.closed(engine_id)
        self._peers[engine_id] = peer
        return peer

    def release_idle(self) -> None:
        """At most once a second: close the links that failed or idled (peer_idle_s),
        and the least recently used beyond max_decode_links."""
        now = time.monotonic()
        if now < self._next_release:
            return
        self._next_release = now + 1.0
        released = set(self._conn.release_peers(self._settings.peer_idle_s, keep=self._settings.max_decode_links))
        if released:
            self._peers = {e: p for e, p in self._peers.items() if p not in released}
            self._metrics.count("peers_released", len(released))
        self._breaker.forget_stale(self._settings.peer_idle_s)
        self._publish()

    def close(self) -> None:
        """Wait for the connections under way (each bounded by its timeouts) and stop
        the connect threads; the connector closes the links."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
