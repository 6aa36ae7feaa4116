"""Prefill: the decode ranks that registered, connected off the receive thread.

A decode rank registers (SGLang's registration message, sent again when it reconnects);
its link is made on a connect thread, so a decode rank that does not answer (packets
dropped: each connection attempt waits out its timeout and retries) delays no other
decode rank's rooms: the receive thread goes on reading. A room that arrives while its
decode rank's link is being made is held, and handled when the attempt ends: with its
peer, or failed with the attempt's error. One attempt per decode rank at a time: a
registration during an attempt is taken up when the attempt ends (its rooms wait for
the latest registration's link). A rank whose last attempt failed, or whose link was
given up since (a write or the control channel timed out: the rank froze, or the network
cut it off), is connected again by its next room, paced by a circuit breaker
(connector/breaker.py, as the vLLM adapter's links): while it backs off, its rooms fail
at once instead of waiting for an attempt that would time out again.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set

from ...connector.breaker import PeerBreaker
from .transfers import unit_mismatch

if TYPE_CHECKING:
    from ...connector import LayerwiseConnector
    from .heads import RankHeads
    from .metrics import Counts

log = logging.getLogger(__name__)

CONNECT_THREADS = 4  # decode ranks connected at once
MAX_HELD_ROOMS = 1024  # per decode rank while it connects; past that, its rooms fail
STALE_BREAKER_S = 300.0  # a failed rank no room asked for since is forgotten
# registrations kept: past that, the least recently used of the ranks with no link, no
# attempt and no held room are forgotten (each restart of a decode server registers
# its ranks under new sessions; the old ones never come back)
MAX_SESSIONS = 1024
HELD = "held"  # peer(): the room is held until its decode rank's link is made


def room_endpoint(msg: List[bytes]) -> str:
    """The ZMQ endpoint of the decode rank that sent a room's destination message."""
    return f"tcp://{msg[1].decode()}:{int(msg[2])}"


class DecodePeers:
    """Decode rank session -> the connector's peer id. ``handle_lock`` is the lock the
    receive thread handles each message under (re-entrant: an attempt may end on the
    thread that asked for it): a held room is handled under it too, by ``replay(msg)``
    once its peer is known (which must not raise), or ended by ``fail(room, reason)``.
    ``heads``: this prefill rank's KV heads when it moves MHA KV by head (None: by
    page); a decode rank that registered the other unit is not linked, and its rooms
    fail naming the setting (before the layout check, which would name bytes only)."""

    def __init__(self, conn: "LayerwiseConnector", handle_lock: "threading.RLock",
                 replay: Callable[[List[bytes]], None], fail: Callable[[int, str], None],
                 breaker: Optional[PeerBreaker] = None, counts: Optional["Counts"] = None,
                 heads: Optional["RankHeads"] = None) -> None:
        self._conn, self._handle_lock = conn, handle_lock
        self._replay, self._fail, self._heads = replay, fail, heads
        self._lock = threading.Lock()
        # session -> its peer_info, as last registered; least recently used first
        self._infos: "OrderedDict[str, dict]" = OrderedDict()
        self._peers: Dict[str, str] = {}
        self._held: Dict[str, List[List[bytes]]] = {}  # session -> rooms waiting for its link
        self._connecting: Set[str] = set()  # sessions with an attempt under way
        # sessions whose last attempt failed or link broke (an empty breaker is falsy: no `or`)
        self._breaker = breaker if breaker is not None else PeerBreaker()
        self._pool = ThreadPoolExecutor(CONNECT_THREADS, thread_name_prefix="kvops-sglang-connect")
        self._counts = counts
        self._linked: Set[str] = set()  # the connector's peers this made and did not release
        self._next_release = 0.0

    def register(self, session: str, info: dict) -> None:
        """Receive thread: a decode rank registered (again): connect it in the
        background, unless it is already linked as registered."""
        with self._lock:
            self._breaker.forget_stale(STALE_BREAKER_S)  # ranks gone for good (restarted anew)
            known = self._infos.get(session)
            self._infos[session] = info
            self._infos.move_to_end(session)
            if known == info and session in self._peers:
                return  # the same rank again: its link stands (the connector checks it)
            self._peers.pop(session, None)
            start = session not in self._connecting
            self._connecting.add(session)
            self._forget_unused()  # never this one: it is connecting
        if start:
            self._pool.submit(self._connect, session)

    def registration(self, session: str) -> Optional[dict]:
        """The peer_info ``session`` last registered (None: never)."""
        with self._lock:
            return self._infos.get(session)

    def peer(self, session: str, msg: List[bytes]) -> Optional[str]:
        """Receive thread, for a room message of ``session``: its peer id; ``HELD`` if
        its link is being made (the room is handled when the attempt ends); None if the
        rank never registered. ``RuntimeError`` (the room fails) while the rank's link
        backs off after a failure, or if too many of its rooms wait for its link."""
        with self._lock:
            peer = self._peers.get(session)
            if peer is not None:
                try:
                    broken = self._conn.peer_failed(peer)
                except KeyError:  # closed by release_dead meanwhile
                    broken = "its link was closed"
                if broken is None:
                    return peer
                log.warning("kvops: decode rank %s: its link was given up (%s); connecting "
                            "it again", session, broken)
                del self._peers[session]
                self._breaker.failed(session, broken)
                self._count("broken")
            if session not in self._infos:
                return None
            self._infos.move_to_end(session)
            if session not in self._connecting and not self._breaker.may_try(session):
                state = self._breaker.states().get(session, {})
                raise RuntimeError(f"decode rank {session}: its link failed ({state.get('reason')}); "
                                   f"connecting again in {state.get('retry_in_s', 0.0):.1f} s")
            held = self._held.setdefault(session, [])
            if len(held) >= MAX_HELD_ROOMS:
                raise RuntimeError(f"decode rank {session}: {len(held)} rooms already wait for "
                                   "its link")
            held.append(msg)
            start = session not in self._connecting  # its last attempt failed: try again
            self._connecting.add(session)
        if start:
            self._pool.submit(self._connect, session)
        return HELD

    def _forget_unused(self) -> None:
        """Under ``_lock``: keep at most MAX_SESSIONS registrations, dropping the least
        recently used of those with no link, attempt or held room. A forgotten rank that
        still lives fails its next room as one that never registered."""
        excess = len(self._infos) - MAX_SESSIONS
        for session in list(self._infos):
            if excess <= 0:
                return
            if session not in self._peers and session not in self._connecting and session not in self._held:
                del self._infos[session]
                excess -= 1

    def __len__(self) -> int:
        """Registrations kept."""
        with self._lock:
            return len(self._infos)

    def held_rooms(self) -> Dict[str, List[int]]:
        """The rooms held while their decode rank's link is made, by the endpoint of
        that rank's ZMQ socket: this server owes them (``KvopsKVManager``'s owed
        notices renew their leases there, so a slow connection fails no room)."""
        with self._lock:
            held = [msg for msgs in self._held.values() for msg in msgs]
        owed: Dict[str, List[int]] = {}
        for msg in held:
            owed.setdefault(room_endpoint(msg), []).append(int(msg[0]))
        return owed

    def release_dead(self) -> None:
        """Between two connector steps (under the manager's step lock), at most once a
        second: close the links the connector gave up (their rank died, restarted under
        a new session, froze or was cut off: the sender finds a closed channel when it
        polls an idle link) that have nothing in flight, so links do not pile up while
        decode servers come and go. A room that still names a closed link is refused
        alone when its step starts (it fails; a rank's next room links it again)."""
        now = time.monotonic()
        if now < self._next_release:
            return
        self._next_release = now + 1.0
        released = set(self._conn.release_peers(math.inf))  # given up only: never a live idle one
        if not released:
            return
        with self._lock:
            self._peers = {s: p for s, p in self._peers.items() if p not in released}
            self._linked -= released
        log.info("kvops: closed the links to decode ranks %s (given up, nothing in flight)",
                 sorted(released))
        self._count("released", len(released))

    def _count(self, event: str, amount: int = 1) -> None:
        if self._counts is not None:
            self._counts.add("kvops_sglang_links", amount, event)

    def close(self) -> None:
        """Wait for the attempts under way (each bounded by the control timeout and its
        retries) and stop the connect threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _connect(self, session: str) -> None:
        """A connect thread: link the rank as last registered; again if it registered
        anew meanwhile; then its held rooms go on, or fail with the error."""
        while True:
            with self._lock:
                info = self._infos[session]
            try:
                mismatch = unit_mismatch(self._heads, info.get("sglang_heads"))
                if mismatch:
                    raise ValueError(mismatch)
                peer, error = self._conn.add_peer(info), None  # validates the layout against ours
            except (ValueError, RuntimeError, ConnectionError, OSError) as exc:
                peer, error = None, f"decode rank {session} could not be connected: {exc}"
                log.warning("kvops: %s", error)
            with self._handle_lock:
                with self._lock:
                    if self._infos[session] != info:
                        continue  # registered anew meanwhile: link that registration
                    self._connecting.discard(session)
                    held = self._held.pop(session, [])
                    if peer is not None:
                        self._peers[session] = peer
                        self._breaker.closed(session)
                        self._count("remade" if peer in self._linked else "made")
                        self._linked.add(peer)
                    else:
                        self._breaker.failed(session, error)
                for msg in held:
                    if peer is not None:
                        self._replay(msg)
                    else:
                        self._fail(int(msg[0]), error)
                return
