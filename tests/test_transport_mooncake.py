"""MooncakeTransport over real Mooncake TCP on loopback between two real processes.

The receiving side runs in a ``spawn`` child process that owns a numpy buffer registered
with its own MooncakeTransport and answers commands over a pipe. Nothing here is skipped:
without the ``mooncake`` package every test fails.

Each test is bounded: pipe reads and joins have timeouts, children are killed in
``finally``, and a faulthandler watchdog ends the whole run if a test hangs anyway.
"""
from __future__ import annotations

import faulthandler
import hashlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
import types

import numpy as np
import pytest

pytestmark = [pytest.mark.process, pytest.mark.alone]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUARD = 0xA5
TEST_HARD_TIMEOUT_S = 90


def _import_transports(stub_package=False):
    """torch_kvops.transports. In the peer processes (``stub_package=True``) it is loaded
    without torch_kvops/__init__, which imports torch and the native extension: that
    keeps each child's start-up well under a second. Never stub in the test process,
    where other test modules need the real package."""
    if stub_package and "torch_kvops" not in sys.modules:
        pkg = types.ModuleType("torch_kvops")
        pkg.__path__ = [os.path.join(ROOT, "torch_kvops")]
        sys.modules["torch_kvops"] = pkg
    import torch_kvops.transports as transports
    return transports


# ---------------------------------------------------------------------- peer process
def _peer_main(conn, size, regions):
    """Receiver: registers ``regions`` (offset, length) of a ``size``-byte buffer."""
    transports = _import_transports(stub_package=True)
    try:
        transport = transports.MooncakeTransport(host="127.0.0.1")
        buf = np.full(size, GUARD, dtype=np.uint8)
        base = buf.ctypes.data
        for off, length in regions:
            transport.register(base + off, length)
        conn.send(("ready", transport.address(), base, os.getpid()))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        cmd = msg[0]
        if cmd == "get":
            conn.send(bytes(buf[msg[1]:msg[1] + msg[2]]))
        elif cmd == "digest":
            conn.send(hashlib.sha256(buf.tobytes()).hexdigest())
        elif cmd == "fill":
            buf[:] = msg[1]
            conn.send(True)
    transport.close()


class Peer:
    def __init__(self, size, regions=None, start_timeout=30.0):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.size = size
        self.proc = ctx.Process(target=_peer_main, args=(child, size, regions or [(0, size)]),
                                daemon=True)
        self.proc.start()
        child.close()
        reply = self.call(None, timeout=start_timeout)
        assert reply[0] == "ready", f"peer failed to start: {reply}"
        _, self.address, self.base, self.pid = reply

    def call(self, msg, timeout=30.0):
        if msg is not None:
            self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise AssertionError(f"peer did not answer {msg!r} within {timeout}s")
        return self.conn.recv()

    def get(self, off, n):
        return self.call(("get", off, n))

    def digest(self):
        return self.call(("digest",))

    def fill(self, value):
        assert self.call(("fill", value))

    def kill(self):
        if self.proc.is_alive():
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except OSError:
                pass
            self.proc.kill()
        self.proc.join(10)
        assert not self.proc.is_alive()

    def stop(self):
        self.conn.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


@pytest.fixture(autouse=True)
def _watchdog():
    faulthandler.dump_traceback_later(TEST_HARD_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def peer():
    p = Peer(160 << 20)
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture()
def transport():
    t = _import_transports().MooncakeTransport(host="127.0.0.1", default_timeout_s=10.0)
    try:
        yield t
    finally:
        t.close(timeout_s=5)


def _source(size, seed):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sigstop(pid, timeout=10.0):
    """SIGSTOP ``pid`` and wait until every one of its threads has actually stopped (on
    a loaded machine a thread can still answer a handshake shortly after os.kill)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(s in "tT" for s in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout}s")


def _thread_count():
    return len(os.listdir("/proc/self/task"))


# ---------------------------------------------------------------------- tests
def test_mooncake_engine_is_importable():
    from mooncake.engine import TransferEngine  # noqa: F401  fails loudly when missing


def test_missing_mooncake_raises_import_error_with_hint(monkeypatch):
    transports = _import_transports()
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(ImportError, match="pip install mooncake-transfer-engine"):
        transports.MooncakeTransport()


def test_init_rejects_foreign_host_and_unknown_protocol():
    transports = _import_transports()
    with pytest.raises(transports.TransportError, match="not an address of this machine") as ei:
        transports.MooncakeTransport(host="203.0.113.7")  # TEST-NET-3: never local
    assert ei.value.transient is False
    with pytest.raises(transports.TransportError, match="unsupported protocol"):
        transports.MooncakeTransport(protocol="carrier-pigeon")
    with pytest.raises(ValueError, match="max_batch_descriptors"):
        transports.MooncakeTransport(max_batch_descriptors=4096)
    has_rdma = os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")
    if not has_rdma:  # Mooncake would silently use TCP: the transport must refuse instead
        transports.MooncakeTransport(host="127.0.0.1").close()  # first engine: process-wide threads
        baseline = _thread_count()
        with pytest.raises(transports.TransportError, match="no RDMA device") as ei:
            transports.MooncakeTransport(protocol="rdma")
        assert ei.value.transient is False
        # the half-made engine is gone at once, not when the traceback is collected
        assert _thread_count() <= baseline


def test_init_refuses_the_unacknowledged_tcp_framing(monkeypatch):
    """Under MC_TCP_PROTO=1 a finished write does not mean its bytes landed, on which
    the connector's notices and the fence rely: refused before an engine starts."""
    transports = _import_transports()
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(transports.TransportError, match="MC_TCP_PROTO=1") as ei:
        transports.MooncakeTransport(host="127.0.0.1")
    assert ei.value.transient is False
    monkeypatch.setenv("MC_TCP_PROTO", "2")  # the acknowledged framing, explicitly
    transports.MooncakeTransport(host="127.0.0.1").close()


def test_register_is_idempotent_and_address_format(transport):
    buf = np.zeros(1 << 20, dtype=np.uint8)
    ptr = buf.ctypes.data
    transport.register(ptr, buf.size)
    transport.register(ptr, buf.size)  # same again: no-op
    with pytest.raises(_import_transports().TransportError):
        transport.register(ptr, buf.size // 2)  # same ptr, other length
    host, port = transport.address().rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    transport.unregister(ptr)
    transport.unregister(ptr)  # unknown now: ignored


@pytest.mark.parametrize("small_prepare", [16, 0], ids=["python-prepare", "numpy-prepare"])
def test_write_is_byte_exact_and_leaves_guard_bytes(peer, small_prepare):
    src = _source(4 << 20, seed=1)
    peer.fill(GUARD)
    # (src offset, dst offset, length): unsorted, some adjacent on both sides (merged),
    # one adjacent only in src, odd sizes and offsets, one zero-length, one large
    # enough to be cut into pieces.
    descs = [(0, 4096, 1000), (1000, 5096, 3000), (4000, 8096, 1),  # src+dst adjacent
             (10_000, 200_000, 333), (10_333, 100_000, 77),         # src adjacent only
             (50_001, 300_001, 65_537), (20_000, 123_457, 0),
             (3 << 20, 1 << 20, (1 << 20) - 13)]                    # > max_descriptor_bytes
    descs = [descs[i] for i in (5, 0, 7, 3, 1, 6, 4, 2)]
    region = 3 << 20
    expected = np.full(region, GUARD, dtype=np.uint8)
    for s, d, n in descs:
        expected[d:d + n] = src[s:s + n]
    base = src.ctypes.data
    t = _import_transports().MooncakeTransport(host="127.0.0.1", max_descriptor_bytes=256 << 10,
                                               max_batch_descriptors=2)
    t._SMALL_PREPARE = small_prepare
    try:
        t.register(base, src.size)
        t.write(peer.address, [base + s for s, _, _ in descs],
                [peer.base + d for _, d, _ in descs], [n for _, _, n in descs], timeout_s=10)
    finally:
        t.close(timeout_s=5)
    got = np.frombuffer(peer.get(0, region), dtype=np.uint8)
    mismatch = np.flatnonzero(got != expected)
    assert mismatch.size == 0, f"{mismatch.size} bytes differ, first at offset {mismatch[0]}"
    # and nothing beyond the checked window was touched
    assert peer.get(region, 4096) == bytes([GUARD]) * 4096


def test_descriptor_preparation_paths_agree(transport):
    """write() prepares few descriptors in plain Python and many with numpy: same result."""
    TransportError = _import_transports().TransportError
    buf = np.zeros(1 << 20, dtype=np.uint8)
    base = buf.ctypes.data
    transport.register(base, 300_000)            # two adjacent regions: merging must stop
    transport.register(base + 300_000, 400_000)  # at the boundary between them
    rng = np.random.default_rng(13)
    transport.max_descriptor_bytes = 5000
    for trial in range(200):
        k = int(rng.integers(1, 12))
        n = rng.integers(0, 9000, k)
        s = rng.integers(0, 700_000 - 9000, k)
        d = rng.integers(0, 1 << 30, k)
        if trial % 3 == 0:  # first one ends exactly at the region boundary
            s[0] = 300_000 - n[0]
        for i in range(1, k):  # make about half of them adjacent to the previous one
            if rng.random() < 0.5:
                s[i] = s[i - 1] + n[i - 1]
                d[i] = d[i - 1] + n[i - 1] if rng.random() < 0.8 else d[i]
        args = ("peer:1", (base + s).tolist(), d.tolist(), n.tolist())
        try:
            small = transport._prepare_small(*args)
        except TransportError as exc:
            small = type(exc)
        transport._SMALL_PREPARE = 0
        try:
            big = transport._prepare(*args)
        except TransportError as exc:
            big = type(exc)
        finally:
            del transport._SMALL_PREPARE
        assert small == big, f"trial {trial}: {args}"
        if not isinstance(small, type):  # every byte exactly once, pieces capped
            assert sum(small[2]) == int(n.sum()) and max(small[2], default=0) <= 5000
    with pytest.raises(TransportError, match="not inside a region"):
        transport._prepare_small("peer:1", [base + 699_999], [0], [2])


@pytest.mark.parametrize("window", [None, 1024])
def test_4096_fragmented_16k_descriptors_arrive_intact(peer, transport, window):
    """Mooncake's TCP transport fails (queue-full) when more than ~2048 transfers to one
    peer are outstanding: 4096 unmergeable descriptors only arrive if write() bounds what
    it has in flight (default window, and the largest allowed one)."""
    if window is not None:
        transport.max_batch_descriptors = window
    n, piece = 4096, 16 << 10
    src = _source(2 * n * piece, seed=2)
    base = src.ctypes.data
    transport.register(base, src.size)
    peer.fill(GUARD)
    # every other 16 KiB source block into reversed destination slots: nothing merges
    s_off = np.arange(n, dtype=np.int64) * 2 * piece
    d_off = (n - 1 - np.arange(n, dtype=np.int64)) * 2 * piece + piece
    expected = np.full(peer.size, GUARD, dtype=np.uint8)
    for so, do in zip(s_off.tolist(), d_off.tolist()):
        expected[do:do + piece] = src[so:so + piece]
    t0 = time.monotonic()
    transport.write(peer.address, (base + s_off).tolist(), (peer.base + d_off).tolist(),
                    [piece] * n, timeout_s=30)
    elapsed = time.monotonic() - t0
    assert peer.digest() == hashlib.sha256(expected.tobytes()).hexdigest(), \
        "destination differs from the expected bytes"
    assert elapsed < 30


def test_unregistered_memory_is_a_permanent_error(peer, transport):
    TransportError = _import_transports().TransportError
    src = _source(1 << 20, seed=3)
    transport.register(src.ctypes.data, src.size)
    peer.fill(GUARD)
    # destination outside the peer's registered buffer: the peer rejects it
    t0 = time.monotonic()
    with pytest.raises(TransportError) as ei:
        transport.write(peer.address, [src.ctypes.data], [peer.base + peer.size + (1 << 20)],
                        [4096], timeout_s=5)
    assert ei.value.transient is False and ei.value.peer == peer.address
    assert time.monotonic() - t0 < 5
    # source not registered here: refused before anything is sent
    other = _source(8192, seed=4)
    with pytest.raises(TransportError, match="not inside a region registered") as ei:
        transport.write(peer.address, [other.ctypes.data], [peer.base], [4096], timeout_s=5)
    assert ei.value.transient is False
    assert peer.get(0, 4096) == bytes([GUARD]) * 4096
    # the transport still works afterwards
    transport.write(peer.address, [src.ctypes.data], [peer.base], [4096], timeout_s=5)
    assert peer.get(0, 4096) == src[:4096].tobytes()


def test_merging_across_peer_regions_and_merge_descriptors_false():
    """Mooncake rejects a destination range that straddles two regions the peer
    registered separately; merge_descriptors=False keeps such descriptors apart."""
    transports = _import_transports()
    half = 1 << 20
    p = Peer(2 * half, regions=[(0, half), (half, half)])
    src = _source(8192, seed=5)
    merged = transports.MooncakeTransport(host="127.0.0.1")
    unmerged = transports.MooncakeTransport(host="127.0.0.1", merge_descriptors=False)
    try:
        args = (p.address, [src.ctypes.data, src.ctypes.data + 4096],
                [p.base + half - 4096, p.base + half], [4096, 4096])
        merged.register(src.ctypes.data, src.size)
        with pytest.raises(transports.TransportError, match="merge_descriptors=False") as ei:
            merged.write(*args, timeout_s=5)
        assert ei.value.transient is False
        unmerged.register(src.ctypes.data, src.size)
        unmerged.write(*args, timeout_s=5)
        assert p.get(half - 4096, 8192) == src.tobytes()
    finally:
        merged.close(timeout_s=5)
        unmerged.close(timeout_s=5)
        p.kill()


def test_write_to_sigkilled_peer_raises_within_bound(transport):
    TransportError = _import_transports().TransportError
    bound = 3.0
    p = Peer(16 << 20)
    try:
        src = _source(16 << 20, seed=6)
        transport.register(src.ctypes.data, src.size)
        transport.write(p.address, [src.ctypes.data], [p.base], [1 << 20], timeout_s=10)
        p.kill()  # SIGKILL
        for size in (4096, 16 << 20):  # the first and a later attempt, small and large
            t0 = time.monotonic()
            with pytest.raises(TransportError) as ei:
                transport.write(p.address, [src.ctypes.data], [p.base], [size], timeout_s=bound)
            elapsed = time.monotonic() - t0
            assert elapsed < bound + 1.5, f"took {elapsed:.2f}s"
            assert ei.value.transient is True and ei.value.peer == p.address
    finally:
        p.kill()


def test_peer_killed_during_stalled_write_fails_fast(transport):
    """A write stuck on a stopped (SIGSTOP) peer fails at once when the peer dies."""
    TransportError = _import_transports().TransportError
    p = Peer(64 << 20)
    src = _source(64 << 20, seed=7)
    transport.register(src.ctypes.data, src.size)
    errors = []
    try:
        transport.write(p.address, [src.ctypes.data], [p.base], [4096], timeout_s=10)
        _sigstop(p.pid)

        def writer():
            try:
                transport.write(p.address, [src.ctypes.data], [p.base], [src.size], timeout_s=20)
                errors.append(None)
            except TransportError as exc:
                errors.append((exc, time.monotonic()))

        th = threading.Thread(target=writer)
        th.start()
        time.sleep(0.5)
        assert th.is_alive(), "write to a stopped peer returned early"
        killed_at = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        th.join(10)
        assert not th.is_alive()
        exc, at = errors[0]
        assert exc.transient is True
        assert at - killed_at < 3.0, f"took {at - killed_at:.2f}s after the kill"
        # the other pieces of that write fail too (queued ones after Mooncake's 1 s
        # reconnect cool-down), which releases the source memory
        transport.unregister(src.ctypes.data, timeout_s=5)
        assert transport.outstanding() == 0
    finally:
        p.kill()


def test_write_to_address_without_listener_raises_within_bound(transport):
    TransportError = _import_transports().TransportError
    src = _source(4096, seed=8)
    transport.register(src.ctypes.data, src.size)
    bound = 2.0
    address = f"127.0.0.1:{_free_port()}"
    for _ in range(2):
        t0 = time.monotonic()
        with pytest.raises(TransportError) as ei:
            transport.write(address, [src.ctypes.data], [0x10000], [4096], timeout_s=bound)
        assert time.monotonic() - t0 < bound + 1.5
        assert ei.value.transient is True and ei.value.peer == address
    with pytest.raises(TransportError, match="host:port") as ei:
        transport.write("no-port-here", [src.ctypes.data], [0x10000], [4096], timeout_s=bound)
    assert ei.value.transient is False


def test_stalled_write_times_out_and_pins_its_memory(transport):
    """SIGSTOPped peer: write() gives up at its deadline although Mooncake would wait
    30 s; the memory stays pinned until the left-over transfer ends."""
    TransportError = _import_transports().TransportError
    p = Peer(64 << 20)
    src = _source(64 << 20, seed=9)
    try:
        transport.register(src.ctypes.data, src.size)
        transport.write(p.address, [src.ctypes.data], [p.base], [4096], timeout_s=10)
        _sigstop(p.pid)
        bound = 1.5
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="timed out") as ei:
            transport.write(p.address, [src.ctypes.data], [p.base], [src.size], timeout_s=bound)
        elapsed = time.monotonic() - t0
        assert bound - 0.05 <= elapsed < bound + 1.0, f"took {elapsed:.2f}s"
        assert ei.value.transient is True
        assert transport.outstanding() > 0
        assert transport.outstanding(p.address) == transport.outstanding()  # all toward this peer
        assert transport.outstanding("127.0.0.1:1") == 0
        with pytest.raises(TransportError, match="still read by"):
            transport.unregister(src.ctypes.data, timeout_s=0.2)
        p.kill()  # left-over transfers now fail and release the memory
        transport.unregister(src.ctypes.data, timeout_s=5)
        assert transport.outstanding() == 0
    finally:
        p.kill()


def test_handshake_with_hung_peer_is_bounded_and_close_is_safe():
    """First contact with a stopped peer: Mooncake's handshake blocks ~60 s; write()
    gives up at its deadline and close() returns within its own bound."""
    transports = _import_transports()
    p = Peer(1 << 20)
    src = _source(4096, seed=10)
    t = transports.MooncakeTransport(host="127.0.0.1")
    try:
        t.register(src.ctypes.data, src.size)
        _sigstop(p.pid)
        for bound in (1.0, 0.5):  # the second write joins the handshake still in progress
            t0 = time.monotonic()
            with pytest.raises(transports.TransportError, match="handshake") as ei:
                t.write(p.address, [src.ctypes.data], [p.base], [4096], timeout_s=bound)
            assert time.monotonic() - t0 < bound + 0.5
            assert ei.value.transient is True
        handshakes = [th for th in threading.enumerate() if th.name.startswith("kvops-mooncake-handshake")]
        assert len(handshakes) == 1
        t0 = time.monotonic()
        t.close(timeout_s=0.5)  # the blocked handshake thread keeps the engine alive
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(transports.TransportError, match="closed"):
            t.write(p.address, [src.ctypes.data], [p.base], [4096], timeout_s=1)
        p.kill()  # the blocked handshake now sees the connection close and returns
        handshakes[0].join(10)
        assert not handshakes[0].is_alive()
    finally:
        t.close(timeout_s=1)
        p.kill()


def test_close_during_write_from_another_thread():
    transports = _import_transports()
    p = Peer(64 << 20)
    src = _source(64 << 20, seed=11)
    t = transports.MooncakeTransport(host="127.0.0.1")
    errors = []
    try:
        t.register(src.ctypes.data, src.size)
        t.write(p.address, [src.ctypes.data], [p.base], [4096], timeout_s=10)
        _sigstop(p.pid)

        def writer():
            try:
                t.write(p.address, [src.ctypes.data], [p.base], [src.size], timeout_s=30)
            except transports.TransportError as exc:
                errors.append(exc)

        th = threading.Thread(target=writer)
        th.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        t.close(timeout_s=1.0)  # + ~0.8 s to destroy the engine (see close())
        assert time.monotonic() - t0 < 3.0
        th.join(5)
        assert not th.is_alive()
        assert len(errors) == 1 and "closed" in str(errors[0]) and errors[0].transient is False
        t.close()  # idempotent
    finally:
        t.close(timeout_s=1)
        p.kill()


def test_register_and_unregister_while_another_thread_writes(peer, transport):
    """The connector's split: a sender thread writes while the main thread registers
    and unregisters other memory; unregistering memory that a write is reading waits
    for that write."""
    a = _source(1 << 20, seed=14)
    others = [np.zeros(64 << 10, dtype=np.uint8) for _ in range(8)]
    transport.register(a.ctypes.data, a.size)
    peer.fill(GUARD)
    stop, errors, writes = threading.Event(), [], [0]

    def sender():
        try:
            while not stop.is_set():
                transport.write(peer.address, [a.ctypes.data + i * 4096 for i in range(0, 256, 2)],
                                [peer.base + i * 4096 for i in range(0, 256, 2)], [4096] * 128,
                                timeout_s=10)
                writes[0] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=sender)
    th.start()
    try:
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            for buf in others:
                transport.register(buf.ctypes.data, buf.size)
            for buf in others:
                transport.unregister(buf.ctypes.data)
        while writes[0] < 3 and th.is_alive() and time.monotonic() < t_end + 5:
            time.sleep(0.01)
        transport.unregister(a.ctypes.data, timeout_s=10)  # waits for the write in flight
        th.join(10)
    finally:
        stop.set()
        th.join(10)
    assert not th.is_alive()
    # the sender ends with "not inside a region registered" once `a` is unregistered
    assert len(errors) == 1 and "not inside a region registered" in str(errors[0]), errors
    assert writes[0] >= 3
    got = np.frombuffer(peer.get(0, 256 * 4096), dtype=np.uint8).reshape(256, 4096)
    assert (got[0::2] == a[:256 * 4096].reshape(256, 4096)[0::2]).all()
    assert (got[1::2] == GUARD).all()


def test_close_does_not_leak_threads(peer):
    """close() destroys the engine and its threads at once, also when the caller still
    holds an exception (and so a traceback) from a failed write()."""
    transports = _import_transports()
    src = _source(1 << 20, seed=12)
    kept = []

    def cycle(fail):
        t = transports.MooncakeTransport(host="127.0.0.1")
        t.register(src.ctypes.data, src.size)
        t.write(peer.address, [src.ctypes.data], [peer.base], [src.size], timeout_s=10)
        if fail:
            try:
                t.write(peer.address, [src.ctypes.data], [peer.base + peer.size], [64], timeout_s=5)
            except transports.TransportError as exc:
                kept.append(exc)
            assert kept
        t.close(timeout_s=5)

    cycle(False)  # the first engine in a process leaves a few process-wide threads behind
    time.sleep(0.2)
    baseline = _thread_count()
    for fail in (True, False):
        cycle(fail)
        assert _thread_count() <= baseline, f"{_thread_count()} threads, {baseline} before"
