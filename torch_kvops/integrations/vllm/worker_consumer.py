"""Decode worker: expects the parts of each request it receives (tp.py) and reports
the request received once every part ended. A part that failed after some chunks
landed leaves its whole blocks usable: the rest become vLLM load errors; so do the
blocks a part reported finished did not cover (no hole goes unnoticed)."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Dict, List, Set, Tuple

from ...heads import expected_parts, part_id
from .metadata import KvopsConnectorMetadata, KvopsSettings
from .tp import latent_expected_parts
from .worker import KvopsWorker

log = logging.getLogger(__name__)

MAX_PREFILL_TP = 64  # the part ids refused for a request whose post got no answer


class ConsumerWorker(KvopsWorker):
    """D's worker side, one per tensor-parallel rank."""

    role = "consumer"

    def __init__(self, settings: KvopsSettings, num_blocks: int, total_kv_heads: int = 1,
                 tp_rank: int = 0, tp_size: int = 1, latent: bool = False) -> None:
        super().__init__(settings, num_blocks, total_kv_heads, tp_rank, tp_size, latent)
        self._recv_tid_to_req: Dict[str, str] = {}  # part id -> request id
        self._recv_left: Dict[str, Set[str]] = {}  # request id -> parts not yet ended
        self._recv_bad: Set[str] = set()  # requests with a failed part
        self._recv_blocks: Dict[str, List[int]] = {}  # request id -> the blocks P fills
        # request id -> blocks every failed part of it filled (absent: no part failed)
        self._recv_valid: Dict[str, Set[int]] = {}
        self._part_units: Dict[str, List[int]] = {}  # part id -> the units it must fill
        self._load_errors: Set[int] = set()  # blocks to report as not loaded (partial failure)
        # transfers that ended before their request reached this worker (P was faster
        # than this engine's step): tid -> (ok, landed chunks), matched in begin_step
        self._early: "OrderedDict[str, Tuple[bool, List[List[int]]]]" = OrderedDict()
        self._ended_ok: Set[str] = set()
        self._ended_failed: Set[str] = set()

    def peer_info(self) -> dict:
        """This rank's consumer peer_info, with its tensor-parallel rank, how its units
        address heads, and vLLM's layout of its cache (kv_layout.py)."""
        return dict(self.conn.peer_info(), tp_rank=self.tp_rank, tp_size=self.tp_size,
                    by_head=self._by_head, latent=self.latent, kv_cache_layout=self.kv_cache_layout)

    def begin_step(self, meta: KvopsConnectorMetadata) -> None:
        for recv in meta.recv:
            self._expect(recv.req_id, recv.transfer_id, recv.prefill_tp, recv.block_ids)
        renewed = 0
        for req_id in meta.renew:  # P said it still owes these: it lives and will push
            for part in self._recv_left.get(req_id, ()):
                renewed += self.conn.renew(part)
        if renewed:
            self.metrics.count("lease_renewals", renewed)

    def _expect(self, req_id: str, transfer_id: str, prefill_tp: int, block_ids: List[int]) -> None:
        """Wait for the parts of ``transfer_id`` this rank receives (tp.py)."""
        engine = self.conn.engine_id
        if prefill_tp <= 0:  # no answer from P: D recomputes and reuses the blocks
            log.warning("request %s: its destination was not accepted by the prefill side", req_id)
            # P may have accepted it all the same (its answer lost or late): refuse any
            # part of it this rank could be sent, so none is written into reused blocks
            self.conn.refuse(part_id(transfer_id, engine, p, self.tp_rank) for p in range(MAX_PREFILL_TP))
            self._ended_failed.add(req_id)
            return
        self._recv_blocks[req_id] = list(block_ids)
        if self.latent:
            parts = latent_expected_parts(transfer_id, engine, block_ids, prefill_tp, self.tp_rank)
        elif self._by_head:
            parts = expected_parts(transfer_id, engine, block_ids, self.total_kv_heads, prefill_tp,
                                   self.tp_size, self.tp_rank)
        else:
            parts = {part_id(transfer_id, engine, self.tp_rank, self.tp_rank): list(block_ids)}
        left = self._recv_left[req_id] = set()
        ended_early = []
        for part, units in parts.items():
            early = self._early.pop(part, None)
            # its units (blocks, or heads of blocks) are the only ones its begins may name
            if early is None and not self.conn.expect(part, blocks=units):
                # an id this rank already reported or refused (a transfer id used again):
                # nothing will come for it, so the request recomputes instead of waiting
                log.error("request %s: transfer part %s was already used here: recomputing", req_id, part)
                self.metrics.count("reused_transfer_ids")
                self._part_failed(req_id, set())
                continue
            left.add(part)
            self._recv_tid_to_req[part] = req_id
            self._part_units[part] = units
            if early is not None:
                ended_early.append((part, early))
        log.debug("expecting %s (%s) at %.4f", transfer_id, list(parts), time.monotonic())
        if not left:
            self._recv_ended(req_id)
        for part, (ok, landed) in ended_early:
            self._part_ended(part, ok, landed)

    def _part_ended(self, part: str, ok: bool, landed: List[List[int]]) -> None:
        """A part of a request this rank expects ended. One reported finished must have
        filled every unit it was expected to (at its last chunk, the chunks that landed
        cover them), else the units not covered are load errors."""
        req_id = self._recv_tid_to_req.pop(part)
        units = self._part_units.pop(part)
        if not ok:
            self._part_failed(req_id, self._valid_blocks(landed))
        else:
            missing = set(units).difference(*landed)
            if missing:
                log.error("request %s: transfer part %s finished without filling %d of its %d units",
                          req_id, part, len(missing), len(units))
                self.metrics.count("incomplete_transfers")
                per_block = len(self.heads) if self._by_head else 1
                self._part_failed(req_id, {u // per_block for u in units}
                                  - {u // per_block for u in missing})
        left = self._recv_left[req_id]
        left.discard(part)
        if not left:
            self._recv_ended(req_id)

    def _part_failed(self, req_id: str, valid: Set[int]) -> None:
        """A part of the request failed, having filled ``valid`` blocks before."""
        self._recv_bad.add(req_id)
        known = self._recv_valid.get(req_id)
        self._recv_valid[req_id] = valid if known is None else known & valid

    def _valid_blocks(self, landed: List[List[int]]) -> Set[int]:
        """Blocks a failed part filled completely: those of the chunks that landed, but
        the last block of the last one, which a chunk boundary may have cut (the next
        chunk would have pushed it again whole)."""
        landed = [chunk for chunk in landed if chunk]
        if not landed:
            return set()
        per_block = len(self.heads) if self._by_head else 1  # units are heads of blocks
        valid = {unit // per_block for chunk in landed for unit in chunk}
        valid.discard(landed[-1][-1] // per_block)
        return valid

    def _recv_ended(self, req_id: str) -> None:
        """Every part of the request ended here: report it once. If a part failed after
        some of its chunks landed, the request is reported received with the blocks not
        filled as load errors (vLLM keeps the prefix before the first of them and
        recomputes the rest); if nothing usable landed, it is reported failed."""
        del self._recv_left[req_id]
        blocks = self._recv_blocks.pop(req_id, [])
        valid = self._recv_valid.pop(req_id, None)
        if req_id not in self._recv_bad:
            self._ended_ok.add(req_id)
            return
        self._recv_bad.discard(req_id)
        missing = [b for b in blocks if b not in valid]
        if blocks and len(missing) < len(blocks):
            self._load_errors.update(missing)
            self.metrics.count("partial_loads")
            self.metrics.count("load_error_blocks", len(missing))
            self._ended_ok.add(req_id)
        else:
            self._ended_failed.add(req_id)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Consumer: blocks of requests reported received in this step's
        get_finished that a failed transfer did not fill (vLLM recomputes from the
        first of them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ completion

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Set[str], Set[str], Set[str]]:
        """(finished_sending, finished_recving, failed_recving) as vLLM request ids: the
        requests whose every part ended here, failed if nothing usable landed."""
        done, failed = self.conn.get_finished()
        if done or failed:
            self.metrics.touch()
        recving, bad = self._ended_ok | self._ended_failed, set(self._ended_failed)
        self._ended_ok, self._ended_failed = set(), set()
        for tid in done | failed:
            landed = self.conn.landed_chunks(tid)
            if tid not in self._recv_tid_to_req:
                self._early[tid] = (tid in done, landed)
                if len(self._early) > 10_000:  # a transfer no request here ever claims
                    dropped, _ = self._early.popitem(last=False)
                    log.warning("transfer %s ended but no request here claimed it", dropped)
                continue
            log.debug("transfer %s landed (%s) at %.4f", tid, "ok" if tid in done else "failed",
                      time.monotonic())
            self._part_ended(tid, tid in done, landed)
        recving |= self._ended_ok | self._ended_failed
        bad |= self._ended_failed
        self._ended_ok, self._ended_failed = set(), set()
        return set(), recving, bad
