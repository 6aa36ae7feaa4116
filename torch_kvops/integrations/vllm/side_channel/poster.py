"""Decode side of the side channel: posts destinations to prefill engines.

Each prefill address gets its own worker thread and bounded queue, so a slow or dead
P delays only the destinations posted to it. A worker with nothing to do for
``idle_s`` ends; at most ``max_peers`` run at once. Every message ends in exactly one
``on_result(transfer_id, answer)`` call, whatever happens: an exception while posting
one message is caught, logged and counted, and the worker goes on with the next.

Liveness questions (:meth:`DestinationPoster.probe`) go through the same worker, after
the posts queued before them, in one attempt of ``probe_timeout_s``:
``on_pending(address, pending, silent)`` gets the transfer ids P still owes, or None if
P did not answer; ``silent`` tells a question that timed out (P may only be slow, on a
loaded host) from one refused or failed (P is gone, or not a kvops prefill side).

Addresses: ``host:port`` (P's side channel) or ``http://host:port`` (P's bootstrap
endpoint, vLLM's ``remote_bootstrap_addr``): the worker asks ``GET /query`` there for
the side-channel address and caches it for ``resolve_ttl_s``. A prefill instance with
data parallelism lists a side channel per DP rank: ``http://host:port#engine_id`` names
the rank by its engine id (vLLM's ``remote_engine_id``).
"""
from __future__ import annotations

import http.client
import json
import logging
import queue
import socket
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from .auth import AuthError, FleetAuth, TlsFiles

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 64 << 10
OUTCOMES = ("posted", "bad_address", "queue_full", "too_many_peers", "unreachable", "refused",
            "bad_answer", "error")
PROBE_OUTCOMES = ("probed", "probe_failed")


def parse_address(address: object) -> Tuple[str, str, int]:
    """(scheme, host, port): scheme "" for a side channel, "http" for a bootstrap
    endpoint; ValueError naming what is wrong otherwise."""
    if not isinstance(address, str) or not address or len(address) > 300:
        raise ValueError(f"prefill address {address!r} is not a string of 1-300 characters")
    scheme, rest = "", address
    if "://" in address:
        scheme, rest = address.split("://", 1)
        rest = rest.partition("#")[0]  # the DP rank's engine id
        if scheme != "http":
            raise ValueError(f"prefill address {address!r}: scheme {scheme!r} is not supported "
                             "(host:port for a side channel, http://host:port for a bootstrap)")
        rest = rest.rstrip("/")
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise ValueError(f"prefill address {address!r} is not host:port (port 1-65535)")
    return scheme, host, int(port)


def _read_line(sock: socket.socket, limit: int, deadline: float) -> bytes:
    data = bytearray()
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no answer within the deadline")
        sock.settimeout(remaining)
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("peer closed before a full line")
        data += chunk
        if len(data) > limit:
            raise ValueError(f"answer longer than {limit} bytes")
    return bytes(data)


def _call_back(callback: Callable, key: str, *values) -> None:
    """Run the scheduler's callback on a worker thread: an error is logged, and the
    worker lives on."""
    try:
        callback(key, *values)
    except Exception:
        log.exception("%s(%s) raised", getattr(callback, "__name__", "callback"), key)


class _Refused(Exception):
    """P answered, and not with a yes: retrying the same message will not help."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


class _Peer:
    """One prefill address: its queue and worker thread."""

    def __init__(self, address: str, capacity: int) -> None:
        self.address = address
        self.queue: "queue.Queue[dict]" = queue.Queue(maxsize=capacity)
        self.thread: Optional[threading.Thread] = None
        self.resolved: Optional[Tuple[str, int, float]] = None  # (host, port, until)
        self.probing = False  # a liveness question is queued or on its way


class DestinationPoster:
    """Decode side: posts each destination on the worker of its prefill address, with
    ``timeout_s`` per attempt (connect, send and answer together) and ``retries``
    retries. Every post ends in one call of ``on_result(transfer_id, answer)``: the
    prefill side's answer (a dict), or None if it refused or could not be reached (the
    request then fails on the decode side)."""

    def __init__(self, on_result: Callable[[str, Optional[dict]], None], timeout_s: float = 2.0,
                 retries: int = 2, capacity: int = 1024, *, auth: Optional[FleetAuth] = None,
                 tls: Optional[TlsFiles] = None, max_peers: int = 256, idle_s: float = 60.0,
                 resolve_ttl_s: float = 30.0,
                 on_pending: Optional[Callable[[str, Optional[List[str]], bool], None]] = None,
                 probe_timeout_s: Optional[float] = None) -> None:
        self._on_result = on_result
        self._on_pending = on_pending
        self._timeout_s, self._retries = timeout_s, retries
        self._probe_timeout_s = timeout_s if probe_timeout_s is None else probe_timeout_s
        self._capacity, self._max_peers, self._idle_s = capacity, max_peers, idle_s
        self._resolve_ttl_s = resolve_ttl_s
        self._auth = auth
        self._tls = tls.client_context() if tls is not None else None
        self._peers: Dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counts: Dict[str, int] = dict.fromkeys(OUTCOMES + PROBE_OUTCOMES, 0)

    @property
    def failures(self) -> int:
        """Posts that ended without P's acceptance (every outcome but ``posted``)."""
        with self._lock:
            return sum(self._counts[k] for k in OUTCOMES if k != "posted")

    def counters(self) -> Dict[str, int]:
        """Cumulative outcomes of posts: ``posted`` and one per failure cause."""
        with self._lock:
            return dict(self._counts)

    def post(self, address: str, message: dict) -> bool:
        """Queue a message for ``address``'s worker; False (and ``on_result(tid, None)``
        at once) if the address is invalid, its queue is full, or too many prefill
        addresses are active. Never raises for a bad address."""
        tid = str(message.get("transfer_id"))
        try:
            parse_address(address)
        except ValueError as exc:
            log.error("transfer %s: %s", tid, exc)
            return self._fail_now(tid, "bad_address")
        outcome = self._enqueue(address, message)
        if outcome is None:
            return True
        log.error("transfer %s not posted to %s: %s", tid, address, outcome)
        return self._fail_now(tid, outcome)

    def probe(self, address: str, transfer_ids: List[str]) -> bool:
        """Ask ``address`` which of ``transfer_ids`` it still owes a push (answered in
        ``on_pending``). False, and no answer, if a question to it is on its way already
        or it cannot be queued (the leases then run on)."""
        with self._lock:
            peer = self._peers.get(address)
            if peer is not None and peer.probing:
                return False
        if self._enqueue(address, {"op": "pending", "transfer_ids": list(transfer_ids)}) is None:
            return True
        self._count("probe_failed")
        return False

    def _enqueue(self, address: str, message: dict) -> Optional[str]:
        """Queue ``message`` on the worker of ``address`` (started if needed); None,
        or why it was not queued."""
        with self._lock:
            if self._stop.is_set():
                outcome = "error"
            else:
                peer = self._peers.get(address)
                if peer is None and len(self._peers) >= self._max_peers:
                    outcome = "too_many_peers"
                else:
                    if peer is None:
                        peer = self._peers[address] = _Peer(address, self._capacity)
                        peer.thread = threading.Thread(target=self._run, args=(peer,), daemon=True,
                                                       name=f"kvops-poster-{address}"[:60])
                        peer.thread.start()
                    try:
                        peer.queue.put_nowait(message)
                        peer.probing = peer.probing or message.get("op") == "pending"
                        return None
                    except queue.Full:
                        outcome = "queue_full"
        return outcome

    def _fail_now(self, tid: str, outcome: str) -> bool:
        self._count(outcome)
        self._report(tid, None)
        return False

    def _count(self, outcome: str) -> None:
        with self._lock:
            self._counts[outcome] += 1

    def _report(self, tid: str, answer: Optional[dict]) -> None:
        _call_back(self._on_result, tid, answer)

    # ------------------------------------------------------------------ worker threads

    def _run(self, peer: _Peer) -> None:
        idle_since = time.monotonic()
        while True:
            try:
                message = peer.queue.get(timeout=0.1)  # short: close() is noticed soon
            except queue.Empty:
                if self._stop.is_set() or time.monotonic() - idle_since >= self._idle_s:
                    with self._lock:  # post() puts under this lock: nothing slips in after
                        if peer.queue.empty():
                            self._peers.pop(peer.address, None)
                            return
                continue
            if message.get("op") == "pending":
                self._ask_pending(peer, message)
                idle_since = time.monotonic()
                continue
            tid, answer, outcome = str(message.get("transfer_id")), None, "error"
            try:
                if self._stop.is_set():
                    raise _Refused("error", "poster closed")
                answer = self._deliver(peer, message)
                outcome = "posted"
            except _Refused as exc:
                outcome = exc.outcome
                log.error("transfer %s: prefill side at %s: %s", tid, peer.address, exc)
            except Exception:  # every message ends in one on_result, and the thread lives
                log.exception("transfer %s: posting to %s failed", tid, peer.address)
            self._count(outcome)
            self._report(tid, answer)
            idle_since = time.monotonic()

    def _ask_pending(self, peer: _Peer, message: dict) -> None:
        """One attempt; the scheduler decides what a silence means."""
        pending, silent = None, False
        try:
            if not self._stop.is_set():
                answer = self._post_once(*self._side_channel(peer), message, self._probe_timeout_s)
                got = answer.get("pending")
                if isinstance(got, list) and all(isinstance(t, str) for t in got):
                    pending = got
                else:
                    log.warning("prefill side at %s answered a liveness question without a list",
                                peer.address)
        except TimeoutError as exc:
            silent = True
            log.warning("prefill side at %s did not answer a liveness question in %.1f s: %s",
                        peer.address, self._probe_timeout_s, exc)
        except (OSError, http.client.HTTPException, _Refused) as exc:  # refused, reset, gone
            peer.resolved = None
            log.warning("prefill side at %s did not answer a liveness question: %s", peer.address, exc)
        except Exception:  # the worker lives on
            log.exception("liveness question to %s failed", peer.address)
        with self._lock:
            peer.probing = False
        self._count("probed" if pending is not None else "probe_failed")
        if self._on_pending is not None:
            _call_back(self._on_pending, peer.address, pending, silent)

    def _deliver(self, peer: _Peer, message: dict) -> dict:
        last: Optional[BaseException] = None
        for attempt in range(self._retries + 1):
            if self._stop.is_set():
                raise _Refused("error", "poster closed")
            try:
                host, port = self._side_channel(peer)
                return self._post_once(host, port, message)
            except (OSError, ConnectionError, TimeoutError, http.client.HTTPException) as exc:
                last = exc
                log.warning("posting %s to %s failed (attempt %d): %s", message.get("transfer_id"),
                            peer.address, attempt + 1, exc)
                peer.resolved = None  # P may have moved: ask its bootstrap again
                time.sleep(0.05 * (2 ** attempt))
        raise _Refused("unreachable", f"unreachable after {self._retries + 1} attempts: {last}")

    def _side_channel(self, peer: _Peer) -> Tuple[str, int]:
        scheme, host, port = parse_address(peer.address)
        if scheme == "":
            return host, port
        if peer.resolved is not None and peer.resolved[2] > time.monotonic():
            return peer.resolved[0], peer.resolved[1]
        conn = http.client.HTTPConnection(host, port, timeout=self._timeout_s)
        try:
            conn.request("GET", "/query")
            response = conn.getresponse()
            body = response.read(MAX_ANSWER_BYTES + 1)
        finally:
            conn.close()
        if response.status != 200 or len(body) > MAX_ANSWER_BYTES:
            raise ConnectionError(f"bootstrap {peer.address}/query answered {response.status}")
        engine = peer.address.partition("#")[2]
        try:
            ranks = list(json.loads(body).values())
            # the DP rank of that engine id; an instance of one rank whatever the id
            entry = next((e for e in ranks if e["engine_id"] == engine), ranks[0] if len(ranks) == 1 else None)
            if entry is None:
                raise _Refused("bad_answer", f"no DP rank of the prefill instance at {peer.address} has "
                                             f"engine id {engine!r} (it lists {len(ranks)})")
            side_host, side_port = parse_address(entry["kvops"]["side_channel"])[1:]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise _Refused("bad_answer", f"bootstrap answer names no kvops side channel ({exc}): "
                                         "is P running KvopsLayerwiseConnector?") from None
        if side_host in ("0.0.0.0", "::", ""):
            side_host = host  # P listens on every interface: reach it where its bootstrap is
        peer.resolved = (side_host, side_port, time.monotonic() + self._resolve_ttl_s)
        return side_host, side_port

    def _post_once(self, host: str, port: int, message: dict,
                   timeout_s: Optional[float] = None) -> dict:
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        if self._auth is not None:
            payload, nonce = self._auth.seal(message, "post")
        else:
            payload, nonce = json.dumps(message).encode() + b"\n", ""
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            sock = raw
            if self._tls is not None:  # the handshake counts against the same deadline
                raw.settimeout(max(0.001, deadline - time.monotonic()))
                sock = self._tls.wrap_socket(raw, server_hostname=host)
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock.sendall(payload)
                answer = _read_line(sock, MAX_ANSWER_BYTES, deadline).strip()
            finally:
                if sock is not raw:
                    sock.close()
        return self._check_answer(answer, nonce)

    def _check_answer(self, answer: bytes, nonce: str) -> dict:
        if not answer.startswith(b"{"):
            raise _Refused("refused", f"refused: {answer[:100].decode(errors='replace')}")
        try:
            reply = json.loads(answer)
            if self._auth is not None:
                reply, _ = self._auth.open(reply, "answer", reply_to=nonce, remember=False)
        except AuthError as exc:
            raise _Refused("bad_answer", f"answer not authentic: {exc}") from None
        except ValueError as exc:
            raise _Refused("bad_answer", f"answer is not JSON: {exc}") from None
        if not isinstance(reply, dict) or reply.get("ok") is not True:
            raise _Refused("refused", f"refused: {reply!r:.100}")
        log.debug("posted at %.4f", time.monotonic())
        return reply

    def close(self, timeout: float = 10.0) -> None:
        """Stop: queued messages end with on_result(tid, None); workers are joined."""
        with self._lock:
            self._stop.set()
            threads = [p.thread for p in self._peers.values() if p.thread is not None]
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise RuntimeError("kvops poster threads did not stop")
