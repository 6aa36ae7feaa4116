"""The receive path (decode side).

Bytes arrive one-sided through the transport (into the KV caches, or into a staging
slot that is scattered on the producer's notice). The control server thread hears
the producer's notices and reports a request finished once the notice for its last
chunk arrives (notices are sent only after the bytes landed), or failed on a failure
notice or when its lease expires.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..control import ControlServer, Session
from ..staging import ConsumerStaging
from ..transports.base import Transport
from .config import ConnectorConfig
from .ledger import ConnectorStats, RequestLedger

log = logging.getLogger(__name__)


@dataclass
class _Incoming:
    deadline: float
    chunks: int = 0
    bytes: int = 0


class ConsumerSide:
    """Control server, request leases and staging areas of a consumer connector."""

    def __init__(self, caches: Sequence[torch.Tensor], transport: Transport, config: ConnectorConfig,
                 ledger: RequestLedger, stats: ConnectorStats, control_host: str,
                 can_stage: bool) -> None:
        self._config = config
        self._ledger = ledger
        self._stats = stats
        self._incoming: Dict[str, _Incoming] = {}
        self._staging: Optional[ConsumerStaging] = None
        if can_stage:
            self._staging = ConsumerStaging(caches, transport, config.staging_slot_bytes,
                                            config.staging_slots, copy_timeout_s=config.event_timeout_s)
        self._server = ControlServer(control_host, self._on_control, self._on_producer_gone,
                                     self._expire_leases, send_timeout_s=config.control_timeout_s)

    @property
    def control_address(self) -> str:
        return self._server.address

    @property
    def in_flight(self) -> int:
        return len(self._incoming)

    def expect(self, req_id: str, lease_s: Optional[float]) -> None:
        with self._ledger.lock:
            if req_id not in self._incoming and not self._ledger.was_reported_locked(req_id):
                self._incoming[req_id] = _Incoming(time.monotonic() + (lease_s or self._config.lease_s))

    def check(self) -> None:
        """Re-raise an error that stopped the control server thread."""
        self._server.check()

    # ------------------------------------------------------------------ control server thread

    def _on_control(self, message: dict, session: Session) -> None:
        """A handler that raises drops only this producer's connection (ControlServer),
        after which the producer fails its requests."""
        op = message.get("op")
        if op == "hello":
            session.producer = str(message["producer"])
            log.info("producer %s connected", session.producer)
            grant = self._staging.grant(session.producer) if self._staging and message.get("staging") else None
            session.reply({"op": "welcome", "staging": grant.to_json() if grant else None})
        elif op == "begin":
            session.reply({"op": "begun", "rejected": self._begin_requests(message["reqs"])})
        elif op == "scatter":
            if self._staging is None or session.producer is None:
                raise ValueError("scatter without a staging grant")
            self._staging.scatter(session.producer, int(message["layer"]), int(message["slot"]),
                                  message["dst"])
            session.reply({"op": "ack", "slot": int(message["slot"])})
        elif op in ("chunk", "failed"):
            self._request_notice(op, str(message["req"]), message)
        else:
            raise ValueError(f"unknown control message {op!r}")

    def _begin_requests(self, req_ids: List[str]) -> List[str]:
        """Start or renew the leases of a step's requests; return those already
        reported (their blocks may be reused: the producer must not write them)."""
        deadline = time.monotonic() + self._config.lease_s
        rejected = []
        with self._ledger.lock:
            for req_id in map(str, req_ids):
                if self._ledger.was_reported_locked(req_id):
                    rejected.append(req_id)
                elif req_id in self._incoming:
                    self._incoming[req_id].deadline = deadline
                else:
                    self._incoming[req_id] = _Incoming(deadline)
        return rejected

    def _request_notice(self, op: str, req_id: str, message: dict) -> None:
        with self._ledger.lock:
            entry = self._incoming.get(req_id)
            if entry is None:  # reported already (lease expired) or never begun
                log.warning("ignoring %r for request %s: not in flight here", op, req_id)
                return
            entry.deadline = time.monotonic() + self._config.lease_s
            if op == "chunk":
                entry.chunks += 1
                entry.bytes += int(message.get("bytes", 0))
                if not message.get("last"):
                    return
                self._stats.add(bytes_sent=entry.bytes)
            else:
                log.warning("request %s failed on the producer: %s", req_id, message.get("reason"))
            del self._incoming[req_id]
            self._ledger.record_locked(req_id, ok=op == "chunk")

    def _on_producer_gone(self, session: Session) -> None:
        if self._staging is not None and session.producer is not None:
            self._staging.release(session.producer)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._ledger.lock:
            expired = [r for r, entry in self._incoming.items() if entry.deadline < now]
            for req_id in expired:
                log.warning("request %s: lease expired before it finished", req_id)
                del self._incoming[req_id]
                self._ledger.record_locked(req_id, ok=False)

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout: float) -> List[str]:
        """Stop the control server, fail what is still expected, release staging.
        Returns the problems met (every release is attempted)."""
        problems = []
        try:
            self._server.close(timeout)
        except RuntimeError as exc:
            problems.append(str(exc))
        with self._ledger.lock:
            for req_id in list(self._incoming):
                self._ledger.record_locked(req_id, ok=False)
            self._incoming.clear()
        if self._staging is not None:
            try:
                self._staging.close()
            except (OSError, RuntimeError) as exc:
                problems.append(f"release failed: {exc}")
        return problems
