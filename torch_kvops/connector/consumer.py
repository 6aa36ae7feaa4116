"""The receive path (decode side).

Bytes arrive one-sided through the transport (into the KV caches, or into a staging
slot that is scattered on the producer's notice). The control server thread hears
the producer's notices and reports a request finished once the notice for its last
chunk arrives (notices are sent only after the bytes landed), or failed on a failure
notice, when its lease expires, or when the connection of the producer that began it
ends.

Trust: only producers that proved they know this consumer's secret get past the
control server's handshake (control/server.py). Among those, a request belongs to the session
that began it: ``chunk``/``failed`` for it from any other session, a ``begin`` for it
from another session, and a ``scatter`` into blocks that no request of the session
covers are ignored and counted (``control_not_owner``, ``scatter_refused``).

The fence (docs/connector.md, consumer_fence.py): a request given up on while its
producer may still write is revoked and reported only once no write can land.
Admission (consumer_admission.py): optionally, a begin starts only requests the engine
expects.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from ..control import ControlServer, Session, new_secret
from ..plan import KVLayout
from ..staging import ConsumerStaging
from ..tls import TlsFiles
from ..transports.base import Transport
from .config import ConnectorConfig
from .consumer_admission import BeginAdmission
from .consumer_fence import ConsumerFence
from .consumer_integrity import ConsumerIntegrity
from .consumer_scatter import ConsumerScatter, ScatterWorkers
from .integrity import BlockDigester
from .ledger import ConnectorStats, RequestLedger
from .verifier import Verifier

log = logging.getLogger(__name__)


@dataclass
class _Incoming:
    deadline: float
    since: float = field(default_factory=time.monotonic)  # renewals end max_wait_s after
    owner: Optional[Session] = None  # the session whose begin claimed it
    blocks: Set[int] = field(default_factory=set)  # destination blocks named by its begins
    # the blocks the engine gave it (expect(blocks=...)): a begin naming any other fails it
    allowed: Optional[FrozenSet[int]] = None
    chunks: int = 0
    bytes: int = 0
    step_dst: List[int] = field(default_factory=list)  # destination blocks of its latest begin
    digest_mode: Optional[str] = None  # integrity: the mode its producer digests in
    digested_layers: Set[int] = field(default_factory=set)  # of the chunk now landing
    landed: List[List[int]] = field(default_factory=list)  # per chunk landed, its blocks
    verifying: bool = False  # every byte landed; the verifier thread decides its outcome
    ended: bool = False  # reported: the verifier skips its remaining layers
    granted_until: float = 0.0  # this side's end of the producer's write lease
    # revoked: reported failed at this time, when no write of its producer can land
    fenced_until: Optional[float] = None
    trust_landed: bool = True  # the landed chunks it will report when the fence ends
    revoke_sent: bool = False  # the producer was asked to stop and acknowledge
    scattering: int = 0  # staging scatters into its blocks still running (consumer_scatter.py)
    end_after_scatter: Optional[Tuple[bool, bool]] = None  # (ok, trust_landed) once they are done

    @property
    def live(self) -> bool:
        return self.fenced_until is None


class ConsumerSide(ConsumerFence, ConsumerIntegrity, BeginAdmission, ConsumerScatter):
    """Control server, request leases and staging areas of a consumer connector (the
    fence: consumer_fence.py; integrity checks: consumer_integrity.py; staging
    scatters: consumer_scatter.py)."""

    def __init__(self, caches: Sequence[torch.Tensor], transport: Transport, config: ConnectorConfig,
                 ledger: RequestLedger, stats: ConnectorStats, control_host: str,
                 can_stage: bool, secret: Optional[str] = None, tls: Optional[TlsFiles] = None,
                 layout: Optional[KVLayout] = None) -> None:
        self._config = config
        self._ledger = ledger
        self._stats = stats
        self._incoming: Dict[str, _Incoming] = {}
        self._held_begins: List[Tuple[float, float, dict, Session]] = []  # consumer_admission.py
        # Per session: destination block -> the owned in-flight request naming it.
        self._owned_blocks: Dict[Session, Dict[int, str]] = {}
        layout = layout or KVLayout.of(caches)
        self._num_blocks = layout.id_limit  # block ids as producers name them (global with spaces)
        self._id_bases = layout.id_bases
        self._staging: Optional[ConsumerStaging] = None
        if can_stage:
            self._staging = ConsumerStaging(caches, transport, config.staging_slot_bytes,
                                            config.staging_slots, copy_timeout_s=config.event_timeout_s)
        # Shared with producers only through peer_info(), or derived from the fleet key
        # by them (secret given); never logged.
        self._secret = secret if secret is not None else new_secret()
        # Verify digests sent by producers (integrity.py), made on first use; host caches only.
        self._caches = list(caches)
        self._digesters: Dict[str, BlockDigester] = {}
        if config.integrity_mode != "off" and all(c.device.type == "cpu" for c in caches):
            self._digester(config.integrity_mode)  # a missing dependency fails here, not mid-push
        self._verifier: Optional[Verifier] = None  # started on the first request to verify
        self._scatters = ScatterWorkers(lambda fn: self._server.call_soon(fn))
        self._server = ControlServer(control_host, self._on_control, self._on_producer_gone,
                                     self._expire_leases, secret=self._secret,
                                     send_timeout_s=config.control_timeout_s,
                                     tls=tls.server_context() if tls is not None else None)

    @property
    def control_address(self) -> str:
        return self._server.address

    @property
    def secret(self) -> str:
        return self._secret

    def counters(self) -> Dict[str, int]:
        """The control server's counters (handshakes refused, connections dropped)."""
        return self._server.counters_snapshot()

    @property
    def in_flight(self) -> int:
        return len(self._incoming)

    def expect(self, req_id: str, lease_s: Optional[float], blocks: Optional[Iterable[int]] = None) -> bool:
        allowed = None if blocks is None else frozenset(int(b) for b in blocks)
        with self._ledger.lock:
            if self._ledger.was_reported_locked(req_id):
                # ended before the engine asked (a fast producer): the next
                # get_finished reports it; reported and handed out before: a reused id
                return self._ledger.undrained_locked(req_id)
            entry = self._incoming.get(req_id)
            if entry is None:
                entry = self._incoming[req_id] = _Incoming(time.monotonic() + (lease_s or self._config.lease_s))
            if allowed is not None:
                entry.allowed = allowed
                if entry.live and not entry.blocks <= allowed:  # begun before the engine asked
                    self._refuse_blocks_locked(req_id, entry, entry.blocks)
            return True

    def renew(self, req_id: str) -> bool:
        now = time.monotonic()
        with self._ledger.lock:
            entry = self._incoming.get(req_id)
            if entry is None or entry.ended or not entry.live:
                return False
            entry.deadline = max(entry.deadline, min(now + self._config.lease_s,
                                                     entry.since + self._config.max_wait_s))
            return True

    def check(self) -> None:
        """Re-raise an error that stopped the control server thread."""
        self._server.check()

    # ------------------------------------------------------------------ control server thread

    def _on_control(self, message: dict, session: Session) -> None:
        """Messages of authenticated sessions (ControlServer ran the handshake). A
        handler that raises drops only this producer's connection, after which the
        producer fails its requests."""
        op = message.get("op")
        if op == "hello":
            log.info("producer %s connected", session.producer)
            grant = self._staging.grant(session.producer) if self._staging and message.get("staging") else None
            session.reply({"op": "welcome", "staging": grant.to_json() if grant else None,
                           "integrity": self._config.integrity_mode})
        elif op == "begin":
            # every field checked here, inside this session's error boundary: a held
            # begin is answered later on the tick, where a bad field would end the
            # control thread for every producer
            self._admit_begin(_begin_fields(message, self._num_blocks), session)
        elif op == "scatter":
            if self._staging is None or not session.staging:
                raise ValueError("scatter without a staging grant")
            self._scatter(message, session, _block_list(message["dst"]))  # consumer_scatter.py
        elif op == "digests":
            self._layer_digests(message, session)
        elif op in ("chunk", "failed"):
            self._request_notice(op, str(message["req"]), message, session)
        elif op == "revoked":
            self._revoke_acknowledged(str(message["req"]), message.get("in_flight"), session)
        else:
            raise ValueError(f"unknown control message {op!r}")

    def _answer_begin(self, message: dict, session: Session, unexpected: List[str],
                      held_s: float = 0.0) -> None:
        """Begin the requests of ``message`` but ``unexpected`` (consumer_admission.py)
        and answer with those this session may not send."""
        begun = dict(message, reqs=[r for r in message["reqs"] if str(r) not in unexpected])
        rejected = self._begin_requests(begun, session) + unexpected
        # the write lease: the producer counts it from before it sent begin, so a begin
        # held here for ``held_s`` is granted that much more (the lease here starts now)
        session.reply({"op": "begun", "rejected": rejected, "grant_s": self._config.lease_s + held_s})

    def _begin_requests(self, message: dict, session: Session) -> List[str]:
        """Start or renew the leases of a step's requests and note which blocks each
        will fill; return those this session may not send: already reported (their
        blocks may be reused) or owned by another session."""
        req_ids, dst = message["reqs"], message["dst"]  # checked by _begin_fields
        deadline = time.monotonic() + self._config.lease_s
        rejected = []
        with self._ledger.lock:
            owned = self._owned_blocks.setdefault(session, {})
            for req_id in req_ids:
                entry = self._incoming.get(req_id)
                if self._ledger.was_reported_locked(req_id) or (entry is not None and not entry.live):
                    rejected.append(req_id)
                    continue
                if entry is None:
                    entry = self._incoming[req_id] = _Incoming(deadline)
                if entry.owner is None:
                    entry.owner = session  # expect() made it, or it is new: the first begin claims it
                elif entry.owner is not session:
                    self._stats.add(control_not_owner=1)
                    log.warning("producer %s: begin for request %s, which producer %s began: refused",
                                session.producer, req_id, entry.owner.producer)
                    rejected.append(req_id)
                    continue
                if entry.allowed is not None and not entry.allowed.issuperset(dst.get(req_id, ())):
                    self._refuse_blocks_locked(req_id, entry, dst[req_id])
                    rejected.append(req_id)
                    continue
                entry.deadline = entry.granted_until = deadline
                entry.step_dst = dst.get(req_id, [])
                for block in dst.get(req_id, ()):
                    entry.blocks.add(block)
                    owned[block] = req_id
        return rejected

    def _refuse_blocks_locked(self, req_id: str, entry: _Incoming, named: Iterable[int]) -> None:
        """Under the ledger lock: its producer named destination blocks the engine did
        not give the request (a wrong plan, a stale or misrouted destination). None of
        them is written (the begin that names them is rejected) and the request fails:
        at once if nothing of it was begun before, else once the fence ends."""
        outside = sorted(set(named) - entry.allowed)
        self._stats.add(begin_blocks_refused=1)
        log.error("request %s: its producer named %d destination blocks the engine did not give it "
                  "(first: %d): refused, the request fails", req_id, len(outside), outside[0])
        self._give_up_locked(req_id, writes_may_land=bool(entry.blocks))  # an earlier begin's

    def _request_notice(self, op: str, req_id: str, message: dict, session: Session) -> None:
        with self._ledger.lock:
            entry = self._incoming.get(req_id)
            if entry is None:  # reported already (lease expired) or never begun
                log.warning("ignoring %r for request %s: not in flight here", op, req_id)
                return
            if entry.owner is not session:
                self._stats.add(control_not_owner=1)
                log.warning("ignoring %r for request %s from producer %s: it did not begin it",
                            op, req_id, session.producer)
                return
            if not entry.live:
                self._stats.add(revoked_notices=1)
                log.warning("ignoring %r for request %s: revoked here already", op, req_id)
                return
            entry.deadline = time.monotonic() + self._config.lease_s
            if op == "failed":
                log.warning("request %s failed on the producer: %s", req_id, message.get("reason"))
                self._stats.add(failed_by_producer=1)
                # The producer sends this once it starts no more writes for the request;
                # a write of it that failed may still be in the transport (Mooncake#4247).
                self._give_up_locked(req_id, writes_may_land=message.get("in_flight") is not False,
                                     after_grant=False)
                return
            entry.chunks += 1
            problem = _byte_count_problem(message, entry.step_dst)
            if problem is None:
                entry.bytes += message["bytes"]
            problem = problem or self._note_landed(entry, message) or self._chunk_digested(entry, message)
            if problem is not None:
                self._fail_integrity_locked(req_id, problem)
                return
            if not message.get("last"):
                return
            self._stats.add(bytes_sent=entry.bytes)
            if entry.digest_mode is None:
                self._end_locked(req_id, ok=True)
                return
            # the outcome once the verifier has checked every layer queued before this
            entry.verifying = True
            self._verifier_locked().submit_final(req_id, entry)

    def _note_landed(self, entry: _Incoming, message: dict) -> Optional[str]:
        """Keep the blocks a chunk notice says landed (every layer of them), so that a
        request that fails later reports what is usable (landed_chunks)."""
        if "dst" not in message:
            return None
        try:
            blocks = _block_list(message["dst"])
        except (TypeError, ValueError):
            return "malformed chunk notice"
        if not set(blocks) <= entry.blocks:
            return "a chunk notice names blocks the request's begin did not name"
        entry.landed.append(blocks)
        return None

    def _end_locked(self, req_id: str, ok: bool, trust_landed: bool = True) -> None:
        """Under the ledger lock: report the request once and forget its blocks. A
        failed request keeps the list of chunks that landed whole (landed_chunks); one
        with a staging scatter still running is reported once it is done."""
        if self._end_waits_for_scatter_locked(self._incoming[req_id], ok, trust_landed):
            return
        entry = self._incoming.pop(req_id)
        entry.ended = True
        if entry.owner is not None:
            owned = self._owned_blocks.get(entry.owner, {})
            for block in entry.blocks:
                if owned.get(block) == req_id:
                    del owned[block]
        # With the integrity check on, bytes count only once verified, and verification
        # runs when the last chunk landed: a failed request's chunks are unverified.
        if not ok and (self._config.integrity_mode != "off" or entry.digest_mode is not None):
            trust_landed = False
        self._ledger.record_locked(req_id, ok=ok, landed=entry.landed if trust_landed else None)

    def _on_producer_gone(self, session: Session) -> None:
        """A connection that ends is a failed peer: its producer fails what it began
        (docs/connector.md), so the requests fail here now instead of at lease expiry."""
        with self._ledger.lock:
            begun = [r for r, entry in self._incoming.items() if entry.owner is session and entry.live]
            for req_id in begun:
                log.warning("request %s: the connection of producer %s ended before it finished",
                            req_id, session.producer)
                self._stats.add(failed_producer_gone=1)
                # An alive producer stops at its next layer (it checks its channel before
                # each write); what it handed to the transport before may still land.
                self._give_up_locked(req_id, after_grant=False)
        self._drop_held_begins(session)
        if self._staging is not None and session.producer is not None:
            self._staging.release(session.producer)

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float) -> List[str]:
        """Stop the control server, fail what is still expected, release staging.
        Returns the problems met (every release is attempted)."""
        problems = []
        try:
            self._server.close(timeout)
        except RuntimeError as exc:
            problems.append(str(exc))
        if self._verifier is not None and not self._verifier.close(timeout):
            problems.append("the integrity verifier thread did not stop within the close timeout")
        if not self._scatters.close(timeout):
            problems.append("a staging scatter did not finish within the close timeout")
        with self._ledger.lock:
            for req_id, entry in list(self._incoming.items()):
                entry.scattering = 0  # the workers are stopped (or abandoned): nothing waits
                self._end_locked(req_id, ok=False)
            self._owned_blocks.clear()
        if self._staging is not None:
            try:
                self._staging.close()
            except (OSError, RuntimeError) as exc:
                problems.append(f"release failed: {exc}")
        return problems


def _byte_count_problem(message: dict, step_dst: List[int]) -> Optional[str]:
    """A chunk notice's byte count must be a count, and zero exactly when the step's
    begin named no destination blocks for the request."""
    count = message.get("bytes")
    if type(count) is not int or count < 0:
        return f"chunk notice with a malformed byte count {count!r}"
    if (count == 0) != (not step_dst):
        return f"chunk notice of {count} bytes for {len(step_dst)} destination blocks"
    return None


def _begin_fields(message: dict, num_blocks: int) -> dict:
    """A begin's requests and destination blocks, checked: ``reqs`` a list of ids
    (strings or integers), ``dst`` (optional) a mapping of id to block ids in range.
    ValueError names the first bad field."""
    reqs, dst = message.get("reqs"), message.get("dst", {})
    if not isinstance(reqs, list) or any(type(r) not in (str, int) for r in reqs):
        raise ValueError("begin: 'reqs' must be a list of request ids")
    if not isinstance(dst, dict):
        raise ValueError("begin: 'dst' must map request ids to block ids")
    blocks = {str(req_id): _block_list(value) for req_id, value in dst.items()}
    for req_id, ids in blocks.items():
        if any(not 0 <= b < num_blocks for b in ids):
            raise ValueError(f"begin: destination blocks of {req_id!r} out of range "
                             f"(this consumer has {num_blocks} blocks)")
    return {"op": "begin", "reqs": [str(r) for r in reqs], "dst": blocks}


def _block_list(value) -> List[int]:
    """Block ids from a control message: a list of integers (bools and floats refused)."""
    if not isinstance(value, list) or any(type(b) is not int for b in value):
        raise ValueError("block ids must be a list of integers")
    return value
