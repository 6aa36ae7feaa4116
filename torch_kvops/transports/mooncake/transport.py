"""``MooncakeTransport``: the :class:`Transport` the connector uses, composed of its parts.

The class checks its settings, starts the engine (:mod:`.engine`), and hands each call
to the part that does the job: registration to :class:`.regions.Registry`, the
handshake to :class:`.handshake.PeerHandshakes`, descriptor preparation to
:mod:`.descriptors`, the transfer to :class:`.write.WriteSession`. What it keeps is the
life cycle that ties them together: which regions a running write pins, what a failed
write leaves behind (:class:`.pins.SourcePins`), and ``close()``.
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from typing import List, Optional, Sequence

from ..base import Transport, TransportError
from .descriptors import Pieces, prepare, prepare_small
from .engine import EngineSlot, check_local_host, engine_supports_cuda, load_engine_class, start_engine
from .engine_log import mooncake_log_mode
from .handshake import PeerHandshakes, split_address
from .pins import SourcePins
from .regions import Registry
from .write import Pacing, WriteSession

__all__ = ["MooncakeTransport"]

log = logging.getLogger(__name__)


class MooncakeTransport(Transport):
    """:class:`Transport` over the Mooncake transfer engine (TCP; RDMA when asked for).

    Args:
        host: this machine's address as peers should reach it (checked to be local).
        protocol: ``"tcp"`` (forces Mooncake's TCP transport even where RDMA devices
            exist) or ``"rdma"`` (fails unless Mooncake finds an RDMA device;
            Mooncake's own initialize() silently falls back to TCP otherwise).
        device_name: RDMA device filter, comma separated (``"mlx5_0,mlx5_1"``).
        max_batch_descriptors: most descriptors of one ``write()`` submitted and not yet
            finished at once. Mooncake's TCP transport queues at most 1024 transfers
            per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``) and fails what does not
            fit after ``MC_TCP_ADMISSION_TIMEOUT_MS`` (1 s), so keep it well below that.
        max_batch_bytes: most bytes of one ``write()`` in flight at once (a single
            descriptor larger than this is still sent, alone).
        max_descriptor_bytes: larger (merged) descriptors are cut into pieces of this
            size, so that one large write spreads over Mooncake's parallel TCP
            connections (``MC_TCP_LANES_PER_PEER``, 4) and reports progress.
        merge_descriptors: merge descriptors whose source and destination ranges are
            both adjacent (and whose sources lie in one registered region). Mooncake
            rejects a write whose destination range is not inside *one* region the
            peer registered, so pass False if the peer registers adjacent buffers
            separately and descriptors may straddle them.
        default_timeout_s: ``write()``'s timeout when ``timeout_s`` is not given.
        close_timeout_s: how long ``close()`` (and ``unregister()`` by default) waits
            for transfers left behind by timed-out writes to finish.
        busy_poll_s: for this long after submitting, ``write()`` polls without sleeping
            (a 16 KiB write completes in ~40 us on loopback, a sleep lasts >= ~150 us).
        min_poll_interval_s, max_poll_interval_s: then it sleeps between status polls,
            starting at the minimum and doubling up to the maximum while nothing
            completes (each poll releases the GIL; a stalled write costs ~5% of a core).
    """

    name = "mooncake"
    _SMALL_PREPARE = 16  # up to this many descriptors are prepared without numpy

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "", *,
                 max_batch_descriptors: int = 256, max_batch_bytes: int = 64 << 20,
                 max_descriptor_bytes: int = 4 << 20, merge_descriptors: bool = True,
                 default_timeout_s: float = 10.0, close_timeout_s: float = 35.0,
                 busy_poll_s: float = 200e-6, min_poll_interval_s: float = 50e-6,
                 max_poll_interval_s: float = 1e-3):
        log_mode = mooncake_log_mode()  # before Mooncake is loaded: it reads MC_LOG_LEVEL
        engine_cls = load_engine_class()
        if protocol not in ("tcp", "rdma"):
            raise TransportError(f"unsupported protocol {protocol!r}: MooncakeTransport supports "
                                 "'tcp' and 'rdma'", transient=False)
        if os.environ.get("MC_TCP_PROTO") == "1":
            # the legacy framing reports a write complete once its bytes left this
            # host's socket, not once they landed: "written" would not mean "landed"
            raise TransportError("MC_TCP_PROTO=1 selects Mooncake's unacknowledged TCP framing, "
                                 "under which a finished write does not mean its bytes landed: "
                                 "unset it", transient=False)
        if not (1 <= int(max_batch_descriptors) <= 1024):
            raise ValueError("max_batch_descriptors must be in [1, 1024] (Mooncake's TCP transport "
                             "queues at most 1024 transfers per peer by default)")
        if int(max_batch_bytes) <= 0 or int(max_descriptor_bytes) <= 0:
            raise ValueError("max_batch_bytes and max_descriptor_bytes must be positive")
        if float(default_timeout_s) <= 0:
            raise ValueError("default_timeout_s must be positive")
        self.host = host
        self.protocol = protocol
        self.device_name = device_name
        self.max_batch_descriptors = int(max_batch_descriptors)
        self.max_batch_bytes = int(max_batch_bytes)
        self.max_descriptor_bytes = int(max_descriptor_bytes)
        self.merge_descriptors = bool(merge_descriptors)
        self.default_timeout_s = float(default_timeout_s)
        self.close_timeout_s = float(close_timeout_s)
        self.busy_poll_s = max(0.0, float(busy_poll_s))
        self.min_poll_interval_s = float(min_poll_interval_s)
        self.max_poll_interval_s = max(float(max_poll_interval_s), self.min_poll_interval_s)

        self._slot = EngineSlot()
        self._pins = SourcePins(self._slot.cond)
        self._registry = Registry(self._slot, self._pins, protocol)
        self._peers = PeerHandshakes(self._slot)
        self._address = ""

        check_local_host(host)
        engine, port = start_engine(engine_cls, host, protocol, device_name,
                                    quiet_log=log_mode == "quiet")
        self._slot.engine = engine
        self._address = f"{host}:{port}"

    # ------------------------------------------------------------------ properties
    def address(self) -> str:
        return self._address

    @property
    def closed(self) -> bool:
        return self._slot.closed

    def __repr__(self) -> str:
        return (f"MooncakeTransport(address={self._address!r}, protocol={self.protocol!r}, "
                f"closed={self._slot.closed})")

    def supports_device(self, device_type: str) -> bool:
        """CPU always; CUDA only with the CUDA build of Mooncake (the
        ``mooncake-transfer-engine`` wheel), whose TCP/RDMA transports read GPU memory."""
        if device_type == "cpu":
            return True
        if device_type == "cuda":
            return engine_supports_cuda()
        return False

    # ------------------------------------------------------------------ registration
    def register(self, ptr: int, length: int, *, exposed: bool = True) -> None:
        """Register ``[ptr, ptr + length)`` (idempotent for the same ``ptr`` and ``length``).
        ``exposed=False`` (a write source only): on TCP, Mooncake never learns of it, so
        no peer can read it (regions.py); RDMA registers it anyway.

        The Mooncake call runs outside this transport's lock, so a long registration
        (RDMA pins the pages) does not hold up a ``write()`` on another thread."""
        self._registry.register(ptr, length, exposed)

    def unregister(self, ptr: int, *, timeout_s: Optional[float] = None) -> None:
        """Unregister the region starting at ``ptr`` (unknown pointers are ignored).

        Waits up to ``timeout_s`` (default ``close_timeout_s``) while transfers that read
        the region are still in flight (left behind by a timed-out ``write()``) and
        raises a transient :class:`TransportError` if they are still running then: the
        memory must stay allocated until a later ``unregister`` succeeds.
        """
        timeout = self.close_timeout_s if timeout_s is None else float(timeout_s)
        self._registry.unregister(ptr, timeout)

    # ------------------------------------------------------------------ write
    def _prepare(self, peer: str, src, dst, lengths) -> Pieces:
        """Validate, merge and cut the descriptors against the registered regions."""
        return prepare(peer, src, dst, lengths, self._registry.index, merge=self.merge_descriptors,
                       piece_bytes=self.max_descriptor_bytes, small=self._SMALL_PREPARE)

    def _prepare_small(self, peer: str, src, dst, lengths) -> Pieces:
        """:meth:`_prepare`'s plain-Python path, whatever the number of descriptors."""
        return prepare_small(peer, src, dst, lengths, self._registry.index,
                             merge=self.merge_descriptors, piece_bytes=self.max_descriptor_bytes)

    def write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int],
              *, timeout_s: Optional[float] = None) -> None:
        """One-sided write of local ``[src[k], src[k] + lengths[k])`` into the peer's
        ``[dst[k], dst[k] + lengths[k])`` for every ``k``.

        Returns only when every byte has landed in the peer's memory. Raises
        :class:`TransportError` within about ``timeout_s`` seconds (default
        ``default_timeout_s``; when a transfer fails, telling a dead peer from a
        rejecting one can add up to one second): ``transient=True`` for a timeout, a
        dead, hung or unreachable peer or a dropped connection; ``False`` for
        unregistered local memory, a peer that rejected the write (its destination
        range is not inside one region the peer registered), invalid arguments or a
        closed transport. Zero-length descriptors are ignored; destination ranges must
        not overlap. Descriptors may be given as lists or numpy arrays.

        After a failed or timed-out write, bytes of it may still land in the peer's
        memory later (Mooncake cannot cancel a submitted transfer; Mooncake#4247): the
        caller must not reuse the destination for other data, or reuse, unregister or
        free the source memory at once. This transport tracks such leftover transfers:
        :meth:`unregister` and :meth:`close` wait (bounded) until they are finished.
        """
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        start = time.monotonic()
        deadline = start + max(0.0, timeout)
        if not isinstance(peer, str):
            raise TransportError(f"peer must be a 'host:port' string, got {peer!r}", transient=False)
        split_address(peer)
        slot = self._slot
        with slot.lock:
            slot.check_open_locked()
            pieces = self._prepare(peer, src, dst, lengths)
            if not pieces[0]:
                return
            session = WriteSession(slot, peer, pieces, self._pacing(), start=start,
                                   deadline=deadline, timeout=timeout)
            touched = set(pieces[3])
            for r in touched:
                self._pins.pin_locked(r)
            slot.active_writes += 1
            self._pins.reap_locked(slot.engine)
        try:
            self._peers.ensure(peer, deadline)
            session.run()
        except BaseException as exc:
            # The helper frames hold the engine; a traceback kept alive by the caller
            # would keep it from being destroyed by close() and have it destroyed at
            # some random garbage collection instead (which stalls the GIL ~1 s).
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            with slot.cond:
                for bid, _, r in session.inflight:  # left behind: still moving bytes
                    self._pins.orphan_locked(bid, r, peer)
                for r in touched:
                    self._pins.unpin_locked(r)
                slot.active_writes -= 1
                slot.cond.notify_all()

    def _pacing(self) -> Pacing:
        # Read at every write: callers may retune these attributes between writes.
        return Pacing(self.max_batch_descriptors, self.max_batch_bytes, self.busy_poll_s,
                      self.min_poll_interval_s, self.max_poll_interval_s)

    # ------------------------------------------------------------------ close
    def outstanding(self, peer: Optional[str] = None) -> int:
        """Transfers (toward ``peer``, or any) left behind by failed or timed-out
        writes that are still running."""
        with self._slot.lock:
            self._pins.reap_locked(self._slot.engine)
            return self._pins.orphans_locked(peer)

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Stop accepting writes, wait (up to ``timeout_s``, default ``close_timeout_s``)
        for a running ``write()`` to return, for handshake threads to end and for
        transfers left behind by timed-out writes to finish; then unregister every
        region and destroy the engine (which closes its connections and threads).
        Idempotent. Problems are logged, not raised.

        Destroying a Mooncake engine takes about 1 s (its handshake listener wakes once a
        second) and holds the GIL meanwhile, so other Python threads stall that long.
        Transfers still running at the end are cancelled by the engine's destruction, so
        their source memory is not read after ``close()`` returns (unless a handshake
        thread still blocked in Mooncake keeps the engine alive; that is logged). Bytes
        already in the kernel's socket buffers (up to a few MiB per connection) can
        still reach the peer's memory later, e.g. when a stopped peer resumes."""
        timeout = self.close_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
        slot = self._slot
        with slot.cond:
            if slot.engine is None:
                return
            slot.closed = True
            while slot.active_writes and time.monotonic() < deadline:
                slot.cond.wait(min(0.01, max(0.0, deadline - time.monotonic())))
            handshakes = self._peers.running_locked()
        PeerHandshakes.join(handshakes, deadline)
        with slot.cond:
            if slot.engine is None:  # a concurrent close() finished meanwhile
                return
            while True:
                self._pins.reap_locked(slot.engine)
                if not self._pins.orphans_locked() or time.monotonic() >= deadline:
                    break
                slot.cond.wait(min(0.01, max(0.0, deadline - time.monotonic())))
            self._warn_left_running(timeout, PeerHandshakes.blocked(handshakes))
            engine = slot.engine
            self._registry.release_all_locked(engine)
            self._pins.clear_locked()
            self._peers.forget_peers_locked()
            slot.engine = None
            slot.cond.notify_all()
        # Dropping the last reference destroys the TransferEngine: it closes its
        # sockets and joins its threads (a handshake thread still inside Mooncake
        # keeps its own reference until it returns).
        del engine

    def _warn_left_running(self, timeout: float, stuck: List[str]) -> None:
        """Log what close() found still running after waiting ``timeout`` (lock held)."""
        if self._slot.active_writes:
            log.warning("MooncakeTransport.close(): a write() is still running after %.1fs",
                        timeout)
        if self._pins.orphans_locked():
            log.warning("MooncakeTransport.close(): %d transfer(s) of timed-out writes still "
                        "running after %.1fs; destroying the engine cancels them",
                        self._pins.orphans_locked(), timeout)
        if stuck:
            log.warning("MooncakeTransport.close(): handshake with %s still blocked in Mooncake; "
                        "its thread ends when Mooncake's handshake times out (about 60 s)",
                        ", ".join(stuck))

    def __del__(self):
        slot = self.__dict__.get("_slot")  # absent when __init__ failed before making it
        try:
            if slot is not None and slot.engine is not None:
                self.close(timeout_s=0.0)
        except Exception as exc:  # noqa: BLE001 - a finalizer must not raise: report it
            log.warning("MooncakeTransport garbage-collected unclosed; closing it failed: %s", exc)
