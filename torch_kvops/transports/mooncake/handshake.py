"""The handshake with a new peer, and probing a peer's handshake port.

The first write to a peer runs Mooncake's handshake (``openSegment``), which can block
for about 60 s against a peer that accepts TCP connections but does not answer (a
stopped or hung process). It runs on a helper thread as a zero-length write, which
touches no memory, so ``write()`` can give up at its deadline without leaving anything
behind that reads the caller's buffers; a later write to the same peer joins the
handshake still running.

:func:`probe_peer` (does the peer's handshake port accept a TCP connection?) tells a
dead peer from a live one that is not a Mooncake endpoint here, and a dead peer from a
rejecting one when a transfer fails (:mod:`.write`).
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from ..base import TransportError
from .engine import DONE, PENDING, EngineSlot

__all__ = ["DIAGNOSIS_S", "Handshake", "PeerHandshakes", "probe_peer", "split_address"]

# Longest time write() spends, after a transfer failed, finding out whether to report it
# as transient (peer gone or hung) or permanent (peer rejected the destination range).
DIAGNOSIS_S = 1.0


def split_address(peer: str) -> Tuple[str, int]:
    """``"host:port"`` (IPv6 hosts in brackets) as (host, port); a permanent
    TransportError if it is not one."""
    host, sep, port = str(peer).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"peer address {peer!r} is not 'host:port'", transient=False, peer=peer)
    return host.strip("[]"), int(port)


def probe_peer(peer: str, until: float) -> Optional[str]:
    """None if the peer's handshake port accepts a TCP connection, else why not."""
    try:
        host, port = split_address(peer)
    except TransportError as exc:
        return str(exc)
    timeout = min(0.5, max(0.05, until - time.monotonic()))
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


class Handshake:
    """A zero-length write to a new peer on a helper thread: it makes Mooncake open the
    peer's segment (handshake) without touching memory."""

    __slots__ = ("peer", "thread", "done", "ok", "error", "elapsed")

    def __init__(self, peer: str):
        self.peer = peer
        self.thread: Optional[threading.Thread] = None
        self.done = threading.Event()
        self.ok = False
        self.error = ""
        self.elapsed = 0.0


class PeerHandshakes:
    """The peers this transport has completed a handshake with, and the handshakes
    running, under the lock of ``slot``."""

    def __init__(self, slot: EngineSlot):
        self._slot = slot
        self._ready: set = set()
        self._running: Dict[str, Handshake] = {}

    def ensure(self, peer: str, deadline: float) -> None:
        """Run (or join) the handshake with ``peer``, giving up at ``deadline``."""
        slot = self._slot
        with slot.lock:
            slot.check_open_locked()
            if peer in self._ready:
                return
            hs = self._running.get(peer)
            if hs is None:
                hs = Handshake(peer)
                # The thread holds its own reference to the engine: if close() runs
                # while Mooncake blocks in the handshake, the engine is only destroyed
                # once the call has returned.
                hs.thread = threading.Thread(target=self._run, args=(hs, slot.engine),
                                             name=f"kvops-mooncake-handshake-{peer}", daemon=True)
                self._running[peer] = hs
                hs.thread.start()
        while not hs.done.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if slot.closed:
                raise TransportError("transport closed during write", transient=False, peer=peer)
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"handshake with {peer} did not complete in time (Mooncake's handshake can "
                    "block about 60 s against a peer that accepts connections but does not "
                    "answer); it continues in the background", transient=True, peer=peer)
        if hs.ok:
            return
        why = probe_peer(peer, time.monotonic() + DIAGNOSIS_S)
        if why is not None:
            raise TransportError(f"cannot reach peer {peer}: {hs.error}; its handshake port "
                                 f"refuses connections ({why}) - is the peer process alive?",
                                 transient=True, peer=peer)
        raise TransportError(f"handshake with {peer} failed: {hs.error}; the address accepts TCP "
                             "connections but did not complete a Mooncake handshake (not a "
                             "Mooncake endpoint?)", transient=False, peer=peer)

    def _run(self, hs: Handshake, engine: Any) -> None:
        t0 = time.monotonic()
        try:
            bid = engine.transfer_submit_write(hs.peer, 0, 0, 0)
            if bid == 0:
                hs.error = "Mooncake could not open the peer's segment (handshake failed)"
            else:
                # A zero-length write completes without a round trip; wait a little anyway.
                end = time.monotonic() + 5.0
                st = engine.transfer_check_status(bid)
                while st == PENDING and time.monotonic() < end:
                    time.sleep(0.001)
                    st = engine.transfer_check_status(bid)
                hs.ok = st == DONE
                if not hs.ok:
                    hs.error = f"zero-length handshake write ended with status {st}"
        except Exception as exc:  # noqa: BLE001 - reported to the waiting writer
            hs.error = f"{type(exc).__name__}: {exc}"
        finally:
            hs.elapsed = time.monotonic() - t0
            with self._slot.cond:
                if hs.ok:
                    self._ready.add(hs.peer)
                if self._running.get(hs.peer) is hs:
                    del self._running[hs.peer]
                self._slot.cond.notify_all()
            hs.done.set()

    def running_locked(self) -> List[Handshake]:
        """The handshakes still running."""
        return list(self._running.values())

    @staticmethod
    def join(handshakes: List[Handshake], deadline: float) -> None:
        """Wait until ``deadline`` for the handshakes' threads to end."""
        for hs in handshakes:
            if hs.thread is not None:
                hs.thread.join(max(0.0, deadline - time.monotonic()))

    @staticmethod
    def blocked(handshakes: List[Handshake]) -> List[str]:
        """The peers whose handshake thread is still inside Mooncake."""
        return [hs.peer for hs in handshakes if hs.thread is not None and hs.thread.is_alive()]

    def forget_peers_locked(self) -> None:
        """Forget completed handshakes (the engine that made them is going away)."""
        self._ready.clear()
