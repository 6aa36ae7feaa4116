"""Mooncake transfer engine transport (``mooncake.engine.TransferEngine``).

Peer-to-peer mode: ``initialize(host, "P2PHANDSHAKE", ...)``, no metadata server; a
peer is addressed as ``"host:rpc_port"``. See docs/mooncake-notes.md for the measured
numbers and failure behaviours behind the choices below. In short:

* ``write()`` submits one Mooncake batch per (merged, size-capped) descriptor with
  ``transfer_submit_write`` and polls ``transfer_check_status``, sleeping between
  polls, with a bounded number of descriptors and bytes in flight. The alternatives
  do not fit: ``transfer_check_status`` on a multi-descriptor batch only looks at the
  batch's first descriptor (it reports "done" while later descriptors are still
  moving), ``get_batch_transfer_status`` and the ``*_sync_*`` calls block and spin a
  core until Mooncake's own timeout (``MC_TRANSFER_TIMEOUT``, at least 5 s), so they
  cannot honour a caller's deadline.
* The first write to a peer runs Mooncake's handshake (``openSegment``), which can
  block for about 60 s against a peer that accepts TCP connections but does not answer
  (a stopped or hung process). It runs on a helper thread as a zero-length write, which
  touches no memory, so ``write()`` can give up at its deadline without leaving
  anything behind that reads the caller's buffers.
* Mooncake's TCP transport does not check that the *source* range is registered (it
  simply reads the pointer), so ``write()`` checks it against this transport's
  registrations before submitting anything.
* Mooncake logs through glog to stderr. By default (``KVOPS_MOONCAKE_LOG=quiet``) this
  transport sets ``MC_LOG_LEVEL=WARNING`` unless the caller set it, and drops the few
  lines that Mooncake's P2P ``initialize()`` prints on every start although nothing is
  wrong (one of them at ERROR level: "Local segment descriptor not found"). Every other
  line, real errors included, is shown. ``KVOPS_MOONCAKE_LOG=verbose`` shows everything.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import re
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .base import Transport, TransportError

__all__ = ["MooncakeTransport", "MOONCAKE_INSTALL_HINT"]

log = logging.getLogger(__name__)

MOONCAKE_INSTALL_HINT = (
    "MooncakeTransport needs the Mooncake transfer engine Python package `mooncake`: "
    "`pip install mooncake-transfer-engine` on CUDA 12 hosts, or "
    "`pip install mooncake-transfer-engine-non-cuda` on CPU-only hosts (that wheel also "
    "needs the OS libraries libibverbs1 and libnuma1, e.g. "
    "`apt-get install libibverbs1 libnuma1`)")

# transfer_check_status results
_DONE, _PENDING, _FAILED, _TIMED_OUT = 1, 0, -1, -2
# Longest time write() spends, after a transfer failed, finding out whether to report it
# as transient (peer gone or hung) or permanent (peer rejected the destination range).
_DIAGNOSIS_S = 1.0

# The environment variable that makes Mooncake install only its TCP transport. Without
# it, TransferEngine.initialize() ignores its protocol argument and installs RDMA
# whenever it discovers an RDMA device, TCP otherwise.
_FORCE_TCP_ENV = "MC_FORCE_TCP"
_ENV_LOCK = threading.Lock()


# Mooncake's log: "quiet" (default) or "verbose" (docs/mooncake-notes.md).
LOG_SWITCH_ENV = "KVOPS_MOONCAKE_LOG"
_LOG_MODES = ("quiet", "verbose")
# Lines Mooncake 0.3.x prints while a P2P-handshake engine starts, none of which means
# anything is wrong: glog's notice that nobody called InitGoogleLogging; the local
# segment looked up before initialize() has added it (logged at ERROR); the default
# allocator for TCP, and the same allocator again for a second engine in one process.
BENIGN_START_LINES = (
    re.compile(rb"Logging before InitGoogleLogging\(\) is written to STDERR"),
    re.compile(rb"transfer_metadata\.cpp:\d+\] Local segment descriptor not found"),
    re.compile(rb"transfer_engine_py\.cpp:\d+\] Using default malloc/free for protocol: tcp"),
    re.compile(rb"transfer_engine_py\.cpp:\d+\] Memory allocator already initialized with: tcp"),
)


def _mooncake_log_mode() -> str:
    """The KVOPS_MOONCAKE_LOG mode; in quiet mode also default MC_LOG_LEVEL to WARNING
    (Mooncake reads it when an engine is made, so this runs before that)."""
    mode = os.environ.get(LOG_SWITCH_ENV, "quiet").strip().lower() or "quiet"
    if mode not in _LOG_MODES:
        raise ValueError(f"{LOG_SWITCH_ENV}={os.environ[LOG_SWITCH_ENV]!r}: expected one of "
                         f"{', '.join(_LOG_MODES)}")
    if mode == "quiet":
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    return mode


@contextlib.contextmanager
def _benign_lines_dropped(enabled: bool) -> Iterator[None]:
    """While the body runs, stderr (fd 2, where glog writes from C++) goes to a
    temporary file; afterwards every line except the known-benign start lines is
    written to the real stderr. Only the engine's start runs under this (milliseconds):
    output of other threads in that window is delayed, never lost, and nothing is
    filtered afterwards, so errors of later transfers show as Mooncake prints them."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                captured.seek(0)
                kept = b"".join(line for line in captured.read().splitlines(keepends=True)
                                if not any(p.search(line) for p in BENIGN_START_LINES))
                while kept:
                    kept = kept[os.write(2, kept):]
    finally:
        os.close(saved)


def _load_engine_class():
    try:
        from mooncake.engine import TransferEngine  # type: ignore
    except ImportError as exc:
        raise ImportError(f"{MOONCAKE_INSTALL_HINT}. Importing mooncake.engine failed: {exc}") from exc
    return TransferEngine


def _split_address(peer: str) -> Tuple[str, int]:
    host, sep, port = str(peer).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise TransportError(f"peer address {peer!r} is not 'host:port'", transient=False, peer=peer)
    return host.strip("[]"), int(port)


def _check_local_host(host: str) -> None:
    """Mooncake's initialize() accepts any host string and advertises it to peers; a
    wrong one only shows up as failed writes later. Binding a socket tells us now."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise TransportError(f"cannot resolve host {host!r}: {exc}", transient=False) from exc
    last: Optional[OSError] = None
    for family, stype, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, stype, proto) as s:
                s.bind(sockaddr)
            return
        except OSError as exc:
            last = exc
    raise TransportError(f"host {host!r} is not an address of this machine ({last}); peers "
                         "could not reach the transport there", transient=False)


class _Handshake:
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
        log_mode = _mooncake_log_mode()  # before Mooncake is loaded: it reads MC_LOG_LEVEL
        engine_cls = _load_engine_class()
        if protocol not in ("tcp", "rdma"):
            raise TransportError(f"unsupported protocol {protocol!r}: MooncakeTransport supports "
                                 "'tcp' and 'rdma'", transient=False)
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

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._regions: Dict[int, int] = {}          # ptr -> length
        self._starts_list: List[int] = []             # sorted region starts
        self._ends_list: List[int] = []
        self._starts = np.zeros(0, dtype=np.uint64)  # the same as arrays
        self._ends = np.zeros(0, dtype=np.uint64)
        self._pins: Dict[int, int] = {}              # region ptr -> in-flight users
        self._orphans: List[Tuple[int, int]] = []    # (batch id, region ptr) of abandoned writes
        self._ready_peers: set = set()
        self._handshakes: Dict[str, _Handshake] = {}
        self._active_writes = 0
        self._closed = False
        self._engine = None
        self._address = ""

        _check_local_host(host)
        with _benign_lines_dropped(log_mode == "quiet"):
            engine = engine_cls()
        try:
            with _benign_lines_dropped(log_mode == "quiet"):
                port = self._initialize(engine, host, protocol, device_name)
        except BaseException as exc:
            # Destroy the half-made engine now rather than whenever the traceback's
            # frames are collected: destruction blocks (with the GIL held) for up to
            # ~1 s, which should not hit some unrelated code later.
            traceback.clear_frames(exc.__traceback__)
            del engine
            raise
        self._engine = engine
        self._address = f"{host}:{port}"

    @staticmethod
    def _initialize(engine, host: str, protocol: str, device_name: str) -> int:
        with _ENV_LOCK:
            previous = os.environ.get(_FORCE_TCP_ENV)
            if protocol == "tcp":
                os.environ[_FORCE_TCP_ENV] = "1"
            elif previous is not None:
                raise TransportError(f"protocol='rdma' requested but {_FORCE_TCP_ENV} is set in the "
                                     "environment, which makes Mooncake use TCP", transient=False)
            try:
                rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
            finally:
                if protocol == "tcp":
                    if previous is None:
                        os.environ.pop(_FORCE_TCP_ENV, None)
                    else:
                        os.environ[_FORCE_TCP_ENV] = previous
        if rc != 0:
            raise TransportError(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', "
                                 f"{protocol!r}, {device_name!r}) failed with {rc}; see Mooncake's "
                                 "log above for the cause", transient=False)
        port = engine.get_rpc_port()  # only after a successful initialize: it crashes before
        if not isinstance(port, int) or port <= 0:
            raise TransportError(f"Mooncake initialized but reports RPC port {port!r}", transient=False)
        if protocol == "rdma":
            MooncakeTransport._check_rdma_devices(engine, device_name)
        return port

    @staticmethod
    def _check_rdma_devices(engine, device_name: str) -> None:
        try:
            topo = json.loads(engine.get_local_topology(device_name or None))
            devices = {d for entry in topo.values() for group in entry for d in group}
        except Exception as exc:  # noqa: BLE001 - any parse problem means "cannot confirm RDMA"
            raise TransportError(f"cannot read Mooncake's RDMA topology to confirm protocol='rdma': "
                                 f"{exc}", transient=False) from exc
        if not devices:
            raise TransportError(f"protocol='rdma' requested but Mooncake found no RDMA device"
                                 f"{' matching ' + repr(device_name) if device_name else ''}; it "
                                 "would silently use TCP instead", transient=False)

    # ------------------------------------------------------------------ properties
    def address(self) -> str:
        return self._address

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return (f"MooncakeTransport(address={self._address!r}, protocol={self.protocol!r}, "
                f"closed={self._closed})")

    # ------------------------------------------------------------------ registration
    def _rebuild_region_index_locked(self) -> None:
        starts = sorted(self._regions)
        self._starts_list = starts
        self._ends_list = [s + self._regions[s] for s in starts]
        self._starts = np.array(self._starts_list, dtype=np.uint64)
        self._ends = np.array(self._ends_list, dtype=np.uint64)

    def supports_device(self, device_type: str) -> bool:
        """CPU always; CUDA only with the CUDA build of Mooncake (the
        ``mooncake-transfer-engine`` wheel), whose TCP/RDMA transports read GPU memory."""
        if device_type == "cpu":
            return True
        if device_type == "cuda":
            import mooncake.engine as engine_module  # already imported by __init__

            return bool(getattr(engine_module, "SUPPORT_CUDA", False))
        return False

    def register(self, ptr: int, length: int) -> None:
        """Register ``[ptr, ptr + length)`` (idempotent for the same ``ptr`` and ``length``).

        The Mooncake call runs outside this transport's lock, so a long registration
        (RDMA pins the pages) does not hold up a ``write()`` on another thread."""
        ptr, length = int(ptr), int(length)
        if ptr <= 0 or length <= 0:
            raise TransportError(f"cannot register ptr={ptr:#x} length={length}", transient=False)
        with self._lock:
            self._check_open_locked()
            known = self._regions.get(ptr)
            if known is not None:
                if known == length:
                    return
                raise TransportError(f"ptr {ptr:#x} is already registered with length {known}, not "
                                     f"{length}; unregister it first", transient=False)
            engine = self._engine
        # batch_register_memory releases the GIL (register_memory does not).
        rc = engine.batch_register_memory([ptr], [length])
        if rc != 0:
            hint = " (it overlaps a registered region)" if rc == -7 else ""
            raise TransportError(f"Mooncake register_memory({ptr:#x}, {length}) failed with "
                                 f"{rc}{hint}", transient=False)
        with self._lock:
            if self._engine is engine and not self._closed:
                self._regions[ptr] = length
                self._rebuild_region_index_locked()
                return
        engine.batch_unregister_memory([ptr])  # closed meanwhile
        raise TransportError("transport was closed during register()", transient=False)

    def unregister(self, ptr: int, *, timeout_s: Optional[float] = None) -> None:
        """Unregister the region starting at ``ptr`` (unknown pointers are ignored).

        Waits up to ``timeout_s`` (default ``close_timeout_s``) while transfers that read
        the region are still in flight (left behind by a timed-out ``write()``) and
        raises a transient :class:`TransportError` if they are still running then: the
        memory must stay allocated until a later ``unregister`` succeeds.
        """
        ptr = int(ptr)
        timeout = self.close_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._engine is None or ptr not in self._regions:
                return
            # Take the region out of the index first, so that new writes cannot use it
            # (and keep pinning it) while we wait for the ones in flight.
            length = self._regions.pop(ptr)
            self._rebuild_region_index_locked()
            while True:
                if self._engine is None:
                    return  # close() ran meanwhile: the engine and its registrations are gone
                self._reap_orphans_locked()
                users = self._pins.get(ptr, 0)
                if users == 0:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._regions[ptr] = length  # still registered: put it back
                    self._rebuild_region_index_locked()
                    raise TransportError(f"region {ptr:#x} is still read by {users} in-flight "
                                         "transfer(s) (a timed-out write may still be moving "
                                         "bytes); keep the memory alive and unregister later",
                                         transient=True)
                self._cond.wait(min(remaining, 0.01))
            self._pins.pop(ptr, None)
            engine = self._engine
        rc = engine.batch_unregister_memory([ptr])
        if rc != 0:
            raise TransportError(f"Mooncake unregister_memory({ptr:#x}) failed with {rc}",
                                 transient=False)

    # ------------------------------------------------------------------ helpers
    def _check_open_locked(self) -> None:
        if self._closed or self._engine is None:
            raise TransportError("transport is closed", transient=False)

    def _reap_orphans_locked(self) -> None:
        """Poll transfers abandoned by timed-out writes; release their regions' pins."""
        if not self._orphans or self._engine is None:
            return
        still = []
        for bid, region in self._orphans:
            if self._engine.transfer_check_status(bid) == _PENDING:
                still.append((bid, region))
            else:  # done, failed or timed out: nothing reads the source any more
                self._unpin_locked(region)
        self._orphans = still

    def _unpin_locked(self, region: int, count: int = 1) -> None:
        left = self._pins.get(region, 0) - count
        if left > 0:
            self._pins[region] = left
        else:
            self._pins.pop(region, None)
            self._cond.notify_all()

    def _prepare(self, peer: str, src, dst, lengths):
        """Validate, merge and cut the descriptors. Returns (src, dst, len, region) lists
        (region = start of the registered source region of each piece)."""
        sized = all(hasattr(x, "__len__") for x in (src, dst, lengths))
        if sized and len(src) == len(dst) == len(lengths) <= self._SMALL_PREPARE:
            return self._prepare_small(peer, src, dst, lengths)
        try:
            s = np.asarray(src, dtype=np.uint64).reshape(-1)
            d = np.asarray(dst, dtype=np.uint64).reshape(-1)
            n = np.asarray(lengths, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TransportError(f"invalid descriptors: {exc}", transient=False, peer=peer) from exc
        if not (s.size == d.size == n.size):
            raise TransportError(f"src, dst and lengths differ in size ({s.size}, {d.size}, "
                                 f"{n.size})", transient=False, peer=peer)
        if n.size and int(n.min()) < 0:
            raise TransportError("negative length in descriptors", transient=False, peer=peer)
        keep = n > 0
        if not keep.all():
            s, d, n = s[keep], d[keep], n[keep]
        length = n.astype(np.uint64)
        if s.size == 0:
            return [], [], [], []
        if s.size > 1 and self.merge_descriptors:
            order = np.argsort(s, kind="stable")
            s, d, length = s[order], d[order], length[order]
        # Source ranges must lie in memory registered here: Mooncake's TCP transport
        # would otherwise read whatever the pointer points at.
        idx = np.searchsorted(self._starts, s, side="right").astype(np.int64) - 1
        bad = idx < 0
        if not bad.any():
            bad = s + length > self._ends[idx]
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise TransportError(f"source range [{int(s[k]):#x}, +{int(length[k])}) is not inside a "
                                 f"region registered with this transport ({int(bad.sum())} of "
                                 f"{s.size} descriptors)", transient=False, peer=peer)
        region = self._starts[idx]
        if s.size > 1 and self.merge_descriptors:
            cont = ((s[:-1] + length[:-1] == s[1:]) & (d[:-1] + length[:-1] == d[1:])
                    & (region[:-1] == region[1:]))
            if cont.any():
                heads = np.flatnonzero(np.concatenate(([True], ~cont)))
                length = np.add.reduceat(length, heads)
                s, d, region = s[heads], d[heads], region[heads]
        cap = np.uint64(self.max_descriptor_bytes)
        if int(length.max()) > self.max_descriptor_bytes:
            pieces = (length + cap - np.uint64(1)) // cap
            owner = np.repeat(np.arange(s.size), pieces.astype(np.int64))
            first = np.repeat(np.cumsum(pieces) - pieces, pieces.astype(np.int64))
            offset = (np.arange(owner.size, dtype=np.uint64) - first) * cap
            s, d, region = s[owner] + offset, d[owner] + offset, region[owner]
            length = np.minimum(length[owner] - offset, cap)
        return s.tolist(), d.tolist(), length.tolist(), region.tolist()

    def _prepare_small(self, peer: str, src, dst, lengths):
        """Same as the numpy path of :meth:`_prepare`, in plain Python: for a handful of
        descriptors the numpy calls cost more (~20 us) than the whole work."""
        try:
            items = [(int(a), int(b), int(c)) for a, b, c in zip(src, dst, lengths, strict=True)]
        except (TypeError, ValueError, OverflowError) as exc:
            raise TransportError(f"invalid descriptors: {exc}", transient=False, peer=peer) from exc
        for a, b, c in items:
            if c < 0:
                raise TransportError("negative length in descriptors", transient=False, peer=peer)
            if a < 0 or b < 0 or a + c >= 1 << 64 or b + c >= 1 << 64:
                raise TransportError(f"invalid descriptor ({a}, {b}, {c})", transient=False,
                                     peer=peer)
        items = [x for x in items if x[2] > 0]
        merge = self.merge_descriptors and len(items) > 1
        if merge:
            items.sort(key=lambda x: x[0])
        starts, ends = self._starts_list, self._ends_list
        s_out: List[int] = []
        d_out: List[int] = []
        n_out: List[int] = []
        r_out: List[int] = []
        bad = 0
        first_bad = None
        for a, b, c in items:
            i = bisect.bisect_right(starts, a) - 1
            if i < 0 or a + c > ends[i]:
                bad += 1
                first_bad = first_bad or (a, c)
                continue
            r = starts[i]
            if (merge and s_out and s_out[-1] + n_out[-1] == a and d_out[-1] + n_out[-1] == b
                    and r_out[-1] == r):
                n_out[-1] += c
            else:
                s_out.append(a)
                d_out.append(b)
                n_out.append(c)
                r_out.append(r)
        if bad:
            raise TransportError(f"source range [{first_bad[0]:#x}, +{first_bad[1]}) is not inside a "
                                 f"region registered with this transport ({bad} of {len(items)} "
                                 "descriptors)", transient=False, peer=peer)
        cap = self.max_descriptor_bytes
        if n_out and max(n_out) > cap:
            s2, d2, n2, r2 = [], [], [], []
            for a, b, c, r in zip(s_out, d_out, n_out, r_out):
                for off in range(0, c, cap):
                    s2.append(a + off)
                    d2.append(b + off)
                    n2.append(min(cap, c - off))
                    r2.append(r)
            return s2, d2, n2, r2
        return s_out, d_out, n_out, r_out

    def _probe_peer(self, peer: str, until: float) -> Optional[str]:
        """None if the peer's handshake port accepts a TCP connection, else why not."""
        try:
            host, port = _split_address(peer)
        except TransportError as exc:
            return str(exc)
        timeout = min(0.5, max(0.05, until - time.monotonic()))
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return None
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"

    def _run_handshake(self, hs: _Handshake, engine) -> None:
        t0 = time.monotonic()
        try:
            bid = engine.transfer_submit_write(hs.peer, 0, 0, 0)
            if bid == 0:
                hs.error = "Mooncake could not open the peer's segment (handshake failed)"
            else:
                # A zero-length write completes without a round trip; wait a little anyway.
                end = time.monotonic() + 5.0
                st = engine.transfer_check_status(bid)
                while st == _PENDING and time.monotonic() < end:
                    time.sleep(0.001)
                    st = engine.transfer_check_status(bid)
                hs.ok = st == _DONE
                if not hs.ok:
                    hs.error = f"zero-length handshake write ended with status {st}"
        except Exception as exc:  # noqa: BLE001 - reported to the waiting writer
            hs.error = f"{type(exc).__name__}: {exc}"
        finally:
            hs.elapsed = time.monotonic() - t0
            with self._cond:
                if hs.ok:
                    self._ready_peers.add(hs.peer)
                if self._handshakes.get(hs.peer) is hs:
                    del self._handshakes[hs.peer]
                self._cond.notify_all()
            hs.done.set()

    def _ensure_peer(self, peer: str, deadline: float) -> None:
        """Run (or join) the handshake with ``peer``, giving up at ``deadline``."""
        with self._lock:
            self._check_open_locked()
            if peer in self._ready_peers:
                return
            hs = self._handshakes.get(peer)
            if hs is None:
                hs = _Handshake(peer)
                # The thread holds its own reference to the engine: if close() runs
                # while Mooncake blocks in the handshake, the engine is only destroyed
                # once the call has returned.
                hs.thread = threading.Thread(target=self._run_handshake, args=(hs, self._engine),
                                             name=f"kvops-mooncake-handshake-{peer}", daemon=True)
                self._handshakes[peer] = hs
                hs.thread.start()
        while not hs.done.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self._closed:
                raise TransportError("transport closed during write", transient=False, peer=peer)
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"handshake with {peer} did not complete in time (Mooncake's handshake can "
                    "block about 60 s against a peer that accepts connections but does not "
                    "answer); it continues in the background", transient=True, peer=peer)
        if hs.ok:
            return
        why = self._probe_peer(peer, time.monotonic() + _DIAGNOSIS_S)
        if why is not None:
            raise TransportError(f"cannot reach peer {peer}: {hs.error}; its handshake port "
                                 f"refuses connections ({why}) - is the peer process alive?",
                                 transient=True, peer=peer)
        raise TransportError(f"handshake with {peer} failed: {hs.error}; the address accepts TCP "
                             "connections but did not complete a Mooncake handshake (not a "
                             "Mooncake endpoint?)", transient=False, peer=peer)

    # ------------------------------------------------------------------ write
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
        _split_address(peer)
        with self._lock:
            self._check_open_locked()
            s, d, n, region = self._prepare(peer, src, dst, lengths)
            if not s:
                return
            touched = set(region)
            for r in touched:
                self._pins[r] = self._pins.get(r, 0) + 1
            self._active_writes += 1
            self._reap_orphans_locked()
        inflight: List[Tuple[int, int, int]] = []  # (batch id, piece index, region)
        try:
            self._ensure_peer(peer, deadline)
            self._transfer(peer, s, d, n, region, inflight, start, deadline, timeout)
        except BaseException as exc:
            # The helper frames hold the engine; a traceback kept alive by the caller
            # would keep it from being destroyed by close() and have it destroyed at
            # some random garbage collection instead (which stalls the GIL ~1 s).
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            with self._cond:
                for bid, _, r in inflight:  # left behind: still moving bytes
                    self._orphans.append((bid, r))
                    self._pins[r] = self._pins.get(r, 0) + 1
                for r in touched:
                    self._unpin_locked(r)
                self._active_writes -= 1
                self._cond.notify_all()

    def _transfer(self, peer, s, d, n, region, inflight, start, deadline, timeout) -> None:
        engine = self._engine
        submit, check = engine.transfer_submit_write, engine.transfer_check_status
        src_l, dst_l, len_l, reg_l = s, d, n, region
        total = len(len_l)
        total_bytes = sum(len_l)
        max_desc, max_bytes = self.max_batch_descriptors, self.max_batch_bytes
        # Mooncake's TCP lanes (4 per peer) serve queued transfers in order, so a
        # transfer behind this many unfinished ones has not started yet.
        scan_depth = 16
        nxt = 0
        bytes_inflight = 0
        sleep = self.min_poll_interval_s
        spin_until = time.monotonic() + self.busy_poll_s
        while True:
            # Submit up to the window.
            while nxt < total and len(inflight) < max_desc and (
                    not inflight or bytes_inflight + len_l[nxt] <= max_bytes):
                bid = submit(peer, src_l[nxt], dst_l[nxt], len_l[nxt])
                if bid == 0:
                    self._fail(peer, f"Mooncake refused to submit descriptor {nxt} of {total}",
                               inflight)
                inflight.append((bid, nxt, reg_l[nxt]))
                bytes_inflight += len_l[nxt]
                nxt += 1
            # Poll the oldest transfers.
            progressed = False
            pending = 0
            i = 0
            while i < len(inflight) and pending < scan_depth:
                bid, k, _ = inflight[i]
                st = check(bid)
                if st == _DONE:
                    bytes_inflight -= len_l[k]
                    del inflight[i]
                    progressed = True
                elif st == _PENDING:
                    pending += 1
                    i += 1
                else:  # _FAILED (id freed by Mooncake) or _TIMED_OUT (id stays allocated)
                    del inflight[i]
                    done_bytes = sum(len_l[:nxt]) - bytes_inflight
                    self._fail(peer,
                               f"Mooncake reported status {st} for descriptor {k} "
                               f"([{src_l[k]:#x}, +{len_l[k]}) -> {dst_l[k]:#x}) after "
                               f"{time.monotonic() - start:.3f}s; {done_bytes} of {total_bytes} "
                               "bytes confirmed", inflight,
                               retry=(src_l[k], dst_l[k], len_l[k], reg_l[k]))
            if nxt >= total and not inflight:
                return
            if self._closed:
                raise TransportError("transport closed during write", transient=False, peer=peer)
            now = time.monotonic()
            if now >= deadline:
                done_bytes = sum(len_l[:nxt]) - bytes_inflight
                raise TransportError(
                    f"write to {peer} timed out after {now - start:.3f}s (timeout_s={timeout}): "
                    f"{done_bytes} of {total_bytes} bytes confirmed, {len(inflight)} descriptor(s) "
                    f"still in flight, {total - nxt} not submitted; in-flight bytes may still land "
                    "later", transient=True, peer=peer)
            if progressed:
                sleep = self.min_poll_interval_s
                if nxt < total and len(inflight) < max_desc:
                    continue  # room in the window: submit more right away
            elif now < spin_until:
                continue  # a short write is usually done within tens of microseconds
            else:
                sleep = min(sleep * 2.0, self.max_poll_interval_s)
            time.sleep(min(sleep, max(0.0, deadline - now)))

    def _fail(self, peer: str, what: str, inflight: list,
              retry: Optional[Tuple[int, int, int, int]] = None) -> None:
        """Raise the TransportError for a failed transfer, classified.

        Mooncake reports every failure as -1. To tell a peer that rejects the write
        (its destination range is not registered there: permanent) from a dead or hung
        peer (worth retrying), check whether the peer's handshake port accepts TCP
        connections and, if it does, write the failed descriptor once more (the very
        same bytes to the very same place, so harmless) and watch it: a prompt failure
        while the port stays open means the peer rejects it, success or silence means the
        first failure was a connection problem. All of this takes at most _DIAGNOSIS_S.
        """
        until = time.monotonic() + _DIAGNOSIS_S
        why = self._probe_peer(peer, until)
        if why is not None:
            raise TransportError(f"write to {peer} failed: {what}; the peer's handshake port "
                                 f"refuses connections ({why}) - peer process gone or restarting?",
                                 transient=True, peer=peer)
        if retry is None:
            raise TransportError(f"write to {peer} failed: {what}", transient=True, peer=peer)
        s, d, n, region = retry
        engine = self._engine
        resent_at = time.monotonic()
        bid = engine.transfer_submit_write(peer, s, d, n) if engine is not None else 0
        if bid == 0:
            raise TransportError(f"write to {peer} failed: {what}", transient=True, peer=peer)
        st = engine.transfer_check_status(bid)
        while st == _PENDING and time.monotonic() < until - 0.1:
            time.sleep(0.002)
            st = engine.transfer_check_status(bid)
        resend_s = time.monotonic() - resent_at
        if st == _PENDING:
            inflight.append((bid, -1, region))  # becomes an orphan; same bytes, same place
            raise TransportError(f"write to {peer} failed: {what}; the peer accepts connections but "
                                 "did not complete a re-send of that descriptor either (peer hung or "
                                 "overloaded?)", transient=True, peer=peer)
        if st == _DONE:
            raise TransportError(f"write to {peer} failed: {what}; a re-send of that descriptor "
                                 "succeeded, so it was a transient connection problem", transient=True,
                                 peer=peer)
        # A rejection comes back within a round trip. A slow failure, or a handshake port
        # that closed meanwhile, means the peer is going away (a killed process closes
        # its sockets one by one, so the first probe may still have been answered).
        why = self._probe_peer(peer, until)
        if why is not None or resend_s > 0.3:
            state = f"now refuses connections ({why})" if why else f"took {resend_s:.2f}s to fail it"
            raise TransportError(f"write to {peer} failed: {what}; a re-send failed too and the peer "
                                 f"{state} - peer process gone or restarting?", transient=True,
                                 peer=peer)
        raise TransportError(
            f"write to {peer} failed: {what}; the peer is up and rejected a re-send as well, so the "
            "destination range is most likely not inside one region registered on the peer (if the "
            "peer registers adjacent buffers separately, construct the transport with "
            "merge_descriptors=False)", transient=False, peer=peer)

    # ------------------------------------------------------------------ close
    def outstanding(self) -> int:
        """Transfers left behind by failed or timed-out writes that are still running."""
        with self._lock:
            self._reap_orphans_locked()
            return len(self._orphans)

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
        with self._cond:
            if self._engine is None:
                return
            self._closed = True
            while self._active_writes and time.monotonic() < deadline:
                self._cond.wait(min(0.01, max(0.0, deadline - time.monotonic())))
            handshakes = [hs for hs in self._handshakes.values()]
        for hs in handshakes:
            if hs.thread is not None:
                hs.thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            if self._engine is None:  # a concurrent close() finished meanwhile
                return
            while True:
                self._reap_orphans_locked()
                if not self._orphans or time.monotonic() >= deadline:
                    break
                self._cond.wait(min(0.01, max(0.0, deadline - time.monotonic())))
            if self._active_writes:
                log.warning("MooncakeTransport.close(): a write() is still running after %.1fs",
                            timeout)
            if self._orphans:
                log.warning("MooncakeTransport.close(): %d transfer(s) of timed-out writes still "
                            "running after %.1fs; destroying the engine cancels them",
                            len(self._orphans), timeout)
            stuck = [hs.peer for hs in handshakes if hs.thread is not None and hs.thread.is_alive()]
            if stuck:
                log.warning("MooncakeTransport.close(): handshake with %s still blocked in Mooncake; "
                            "its thread ends when Mooncake's handshake times out (about 60 s)",
                            ", ".join(stuck))
            engine = self._engine
            regions = list(self._regions)
            if regions:
                rc = engine.batch_unregister_memory(regions)
                if rc != 0:
                    log.warning("MooncakeTransport.close(): unregister_memory failed with %d", rc)
            self._regions.clear()
            self._pins.clear()
            self._orphans.clear()
            self._rebuild_region_index_locked()
            self._ready_peers.clear()
            self._engine = None
            self._cond.notify_all()
        # Dropping the last reference destroys the TransferEngine: it closes its
        # sockets and joins its threads (a handshake thread still inside Mooncake
        # keeps its own reference until it returns).
        del engine

    def __del__(self):
        try:
            if self._engine is not None:
                self.close(timeout_s=0.0)
        except Exception as exc:  # noqa: BLE001 - a finalizer must not raise: report it
            log.warning("MooncakeTransport garbage-collected unclosed; closing it failed: %s", exc)
