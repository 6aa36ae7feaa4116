"""Loading and starting the Mooncake transfer engine, and the slot that holds it.

Peer-to-peer mode: ``initialize(host, "P2PHANDSHAKE", ...)``, no metadata server; a
peer is addressed as ``"host:rpc_port"``. :func:`start_engine` checks that the host is
an address of this machine (Mooncake accepts any string and advertises it), forces
Mooncake's TCP transport when TCP is asked for (Mooncake otherwise installs RDMA
whenever it finds a device), confirms an RDMA device when RDMA is asked for (Mooncake
otherwise falls back to TCP silently), draws the handshake port again where an
engine of this host drew it lately (:mod:`.ports`), and runs under the log filter of
:mod:`.engine_log`.

:class:`EngineSlot` is the engine one ``MooncakeTransport`` uses, its closed flag and
the condition that guards them together with the bookkeeping of every other part
(registrations, handshakes, pinned regions, writes in flight).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import traceback
from typing import Any, Optional, Tuple

from ..base import TransportError
from .engine_log import benign_lines_dropped
from .ports import RecentPorts

log = logging.getLogger(__name__)

__all__ = ["DONE", "EngineSlot", "FAILED", "MOONCAKE_INSTALL_HINT", "PENDING", "TIMED_OUT",
           "check_local_host", "engine_supports_cuda", "load_engine_class", "start_engine"]

MOONCAKE_INSTALL_HINT = (
    "MooncakeTransport needs the Mooncake transfer engine Python package `mooncake`: "
    "`pip install mooncake-transfer-engine` on CUDA 12 hosts, or "
    "`pip install mooncake-transfer-engine-non-cuda` on CPU-only hosts (that wheel also "
    "needs the OS libraries libibverbs1 and libnuma1, e.g. "
    "`apt-get install libibverbs1 libnuma1`)")

# transfer_check_status results
DONE, PENDING, FAILED, TIMED_OUT = 1, 0, -1, -2

# The environment variable that makes Mooncake install only its TCP transport. Without
# it, TransferEngine.initialize() ignores its protocol argument and installs RDMA
# whenever it discovers an RDMA device, TCP otherwise.
_FORCE_TCP_ENV = "MC_FORCE_TCP"
_ENV_LOCK = threading.Lock()
MAX_PORT_DRAWS = 8  # with 512 of the 2,000 ports recent, 8 repeats in a row: 1 in 54,000


class EngineSlot:
    """The engine of one transport, whether the transport is closed, and how many
    ``write()`` calls are running, guarded by ``cond`` (``lock`` is its lock). Every
    part of the transport keeps its bookkeeping under this one lock; methods named
    ``*_locked`` expect the caller to hold it. ``engine`` is None before the start
    and after ``close()``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.engine: Any = None
        self.closed = False
        self.active_writes = 0

    def check_open_locked(self) -> None:
        """Raise a permanent TransportError if the transport is closed (or never started)."""
        if self.closed or self.engine is None:
            raise TransportError("transport is closed", transient=False)


def load_engine_class():
    """``mooncake.engine.TransferEngine``, or ImportError with the install hint."""
    try:
        from mooncake.engine import TransferEngine  # type: ignore
    except ImportError as exc:
        raise ImportError(f"{MOONCAKE_INSTALL_HINT}. Importing mooncake.engine failed: {exc}") from exc
    return TransferEngine


def engine_supports_cuda() -> bool:
    """Whether the installed Mooncake is the CUDA build (its transports read GPU memory)."""
    import mooncake.engine as engine_module  # already imported by load_engine_class

    return bool(getattr(engine_module, "SUPPORT_CUDA", False))


def check_local_host(host: str) -> None:
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


def start_engine(engine_cls, host: str, protocol: str, device_name: str, *,
                 quiet_log: bool, recent_ports: Optional[RecentPorts] = None) -> Tuple[Any, int]:
    """Make and initialize an engine; returns it and its RPC (handshake) port, one
    that no engine of this host drew lately (``recent_ports``, :mod:`.ports`): a
    repeat is drawn again while the repeated engine stays bound. ``quiet_log`` drops
    Mooncake's known-benign start-up lines."""
    recent_ports = recent_ports or RecentPorts()
    engine, port = _start_one(engine_cls, host, protocol, device_name, quiet_log)
    repeats = []  # kept alive until a fresh port is drawn, so no draw lands on them
    try:
        for draw in range(1, MAX_PORT_DRAWS + 1):
            if recent_ports.claim(f"{host}:{port}"):
                return engine, port
            if draw == MAX_PORT_DRAWS:
                break
            log.info("Mooncake drew handshake port %d, used lately on this host: drawing again", port)
            repeats.append(engine)
            engine, port = _start_one(engine_cls, host, protocol, device_name, quiet_log)
        log.warning("Mooncake drew %d handshake ports in a row used lately on this host; keeping "
                    "%d (a producer that wrote to its earlier holder cannot write here)",
                    MAX_PORT_DRAWS, port)
        return engine, port
    finally:
        del repeats  # destroying an engine blocks ~1 s: only on a repeat


def _start_one(engine_cls, host: str, protocol: str, device_name: str,
               quiet_log: bool) -> Tuple[Any, int]:
    with benign_lines_dropped(quiet_log):
        engine = engine_cls()
    try:
        with benign_lines_dropped(quiet_log):
            port = _initialize(engine, host, protocol, device_name)
    except BaseException as exc:
        # Destroy the half-made engine now rather than whenever the traceback's
        # frames are collected: destruction blocks (with the GIL held) for up to
        # ~1 s, which should not hit some unrelated code later.
        traceback.clear_frames(exc.__traceback__)
        del engine
        raise
    return engine, port


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
        _check_rdma_devices(engine, device_name)
    return port


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
