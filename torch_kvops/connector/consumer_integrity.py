"""The consumer's integrity checks (integrity.py, docs/connector.md): ``digests``
notices are checked and queued on the verifier thread (verifier.py), and a request
whose chunks were not all digested, or whose digests do not match, fails.

A part of :class:`~torch_kvops.connector.consumer.ConsumerSide`, kept apart because it
is one job: it reads the connector's request table (``_incoming``, under the ledger
lock) and ends requests through its ``_end_locked``.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, Optional

import numpy as np

from ..control import Session
from .config import INTEGRITY_MODES, ConnectorConfig
from .integrity import DIGEST_BYTES, BlockDigester, make_digester
from .ledger import ConnectorStats, RequestLedger
from .verifier import Verifier

if TYPE_CHECKING:
    import torch

    from .consumer import _Incoming

log = logging.getLogger(__name__)


class ConsumerIntegrity:
    """Integrity checks of a consumer connector (mixed into ConsumerSide)."""

    # set by ConsumerSide.__init__
    _config: ConnectorConfig
    _ledger: RequestLedger
    _stats: ConnectorStats
    _caches: "list[torch.Tensor]"
    _secret: str
    _id_bases: "list[int]"
    _incoming: "Dict[str, _Incoming]"
    _digesters: Dict[str, BlockDigester]
    _verifier: Optional[Verifier]

    def _end_locked(self, req_id: str, ok: bool, trust_landed: bool = True) -> None:
        raise NotImplementedError  # ConsumerSide's

    def _give_up_locked(self, req_id: str, writes_may_land: bool = True, after_grant: bool = True,
                        trust_landed: bool = True) -> None:
        raise NotImplementedError  # ConsumerSide's

    def _verifier_locked(self) -> Verifier:
        if self._verifier is None:
            self._verifier = Verifier(self._verified, self._stats)
        return self._verifier

    def _verified(self, req_id: str, entry: _Incoming, problem: Optional[str]) -> None:
        """Verifier thread: the outcome of a request whose every byte had landed."""
        with self._ledger.lock:
            if self._incoming.get(req_id) is not entry or not entry.live:  # ended meanwhile (close)
                return
            if problem is not None:
                self._fail_integrity_locked(req_id, problem)
            else:
                self._end_locked(req_id, ok=True)

    def _layer_digests(self, message: dict, session: Session) -> None:
        """A ``digests`` notice: one layer of the step's requests has landed; queue its
        verification. A request whose notice is malformed, in a mode weaker than this
        consumer asks for, or the wrong size for its blocks fails here."""
        layer, mode, reqs = message.get("layer"), message.get("mode"), message.get("reqs")
        firsts = message.get("first", {})  # requests whose layer moved its blocks from the k-th on
        if (type(layer) is not int or not 0 <= layer < len(self._caches) or not isinstance(reqs, dict)
                or not isinstance(firsts, dict)):
            raise ValueError("malformed digests notice")
        with self._ledger.lock:
            for req_id, digests in reqs.items():
                entry = self._incoming.get(str(req_id))
                if entry is None or entry.verifying or not entry.live:
                    continue  # reported or revoked already (e.g. failed an earlier layer)
                if entry.owner is not session:
                    self._stats.add(control_not_owner=1)
                    log.warning("ignoring digests for request %s from producer %s: it did not "
                                "begin it", req_id, session.producer)
                    continue
                first = firsts.get(req_id, 0)
                problem = self._digests_problem(entry, mode, digests, first)
                if problem is not None:
                    self._fail_integrity_locked(str(req_id), problem)
                    continue
                entry.digest_mode = mode
                entry.digested_layers.add(layer)
                if first < len(entry.step_dst):
                    self._verifier_locked().submit_layer(str(req_id), entry, self._digester(mode), layer,
                                                         np.array(entry.step_dst[first:], dtype=np.int64),
                                                         bytes.fromhex(digests))

    def _digests_problem(self, entry: _Incoming, mode, digests, first) -> Optional[str]:
        if mode not in INTEGRITY_MODES or mode == "off":
            return f"digests in an unknown mode {mode!r}"
        if INTEGRITY_MODES.index(mode) < INTEGRITY_MODES.index(self._config.integrity_mode):
            return f"digests in mode {mode!r}; this consumer asks for {self._config.integrity_mode!r}"
        if entry.digest_mode not in (None, mode):
            return f"digests in mode {mode!r} after {entry.digest_mode!r}"
        if any(c.device.type != "cpu" for c in self._caches):
            return "digests for device caches: the integrity check needs host caches"
        if type(first) is not int or not 0 <= first <= len(entry.step_dst):
            return f"digests from block {first!r} of the step's {len(entry.step_dst)}"
        if not isinstance(digests, str) or len(digests) != 2 * DIGEST_BYTES * (len(entry.step_dst) - first):
            return "malformed digests (not one per block of the step)"
        try:
            bytes.fromhex(digests)
        except ValueError:
            return "malformed digests"
        return None

    def _digester(self, mode: str) -> BlockDigester:
        if mode not in self._digesters:
            self._digesters[mode] = make_digester(mode, self._caches, self._secret, id_bases=self._id_bases)
        return self._digesters[mode]

    def _chunk_digested(self, entry: _Incoming, message: dict) -> Optional[str]:
        """At a chunk notice: the reason to fail the request if its step's layers were
        not all digested where the check is on (either side asked for it)."""
        layers, entry.digested_layers = entry.digested_layers, set()
        checked = entry.digest_mode is not None or self._config.integrity_mode != "off"
        # what the begin named, not what the notice claims: a notice cannot opt out
        if not checked or not entry.step_dst:
            return None
        missing = sorted(set(range(len(self._caches))) - layers)
        if missing:
            return (f"the producer sent no digests for layers {missing[:8]} of this chunk "
                    f"(integrity_check is {self._config.integrity_mode!r} here)")
        return None

    def _fail_integrity_locked(self, req_id: str, reason: str) -> None:
        self._stats.add(integrity_failures=1)
        log.error("request %s failed the integrity check: %s", req_id, reason)
        # no landed chunk is vouched for: the bytes or the notices are not what was sent;
        # a request failed before its last chunk may still be written to (the fence)
        entry = self._incoming[req_id]
        self._give_up_locked(req_id, writes_may_land=not entry.verifying, trust_landed=False)
