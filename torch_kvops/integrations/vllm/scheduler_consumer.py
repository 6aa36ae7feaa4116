"""D's scheduler side: claims a remote-prefilled prompt as an asynchronous external
hit, allocates its blocks and posts them (the destination) to the request's prefill
engine through the side channel; reports how many prompt tokens D computed itself.

Liveness: every sixth of the lease, D asks each prefill engine it waits for which of
its transfers it still owes (side_channel/server.py) and has the workers renew the
leases of those, so a request queued on a busy P is not given up on while P lives;
the connector's ``max_wait_s`` bounds the renewals. A question that times out is a
silence, not a death: on an overloaded host a live P can be seconds late. While P
answered within the last lease, a silence renews every transfer D still waits on from
it; a P silent for a whole lease, or one that refuses the connection, renews nothing,
and its transfers end on their own term. An answer is P's word when it was asked: one
computed before P settled a transfer may arrive after, and renews it once more."""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from .metadata import KvopsConnectorMetadata, KvopsSettings, RecvReq
from .metrics import KvopsConnectorStats, SchedulerCounts
from .params import BadTransferParams, DecodeParams, decode_params
from .side_channel.engine import SideChannelCounts, start_poster
from .side_channel.server import MAX_PROBED

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class ConsumerScheduler:
    """D side: claims the prompt as an asynchronous external hit, allocates, and posts
    the destination to the request's prefill side."""

    def __init__(self, settings: KvopsSettings, block_size: int) -> None:
        self.settings, self.block_size = settings, block_size
        self._lease_s = settings.connector_config().lease_s
        self._probe_every_s = self._lease_s / 6
        # one question per P at a time, so its timeout is also the longest gap between two
        self.poster = start_poster(settings, self._posted, self._pending,
                                   probe_timeout_s=max(settings.post_timeout_s, self._probe_every_s))
        # transfer id -> (request id, P's address) while P owes its push: asked about
        self._owed: Dict[str, Tuple[str, str]] = {}
        # (address, what it owes or None, silent) from the poster threads
        self._pending_answers: "deque[Tuple[str, Optional[List[str]], bool]]" = deque()
        self._answered_at: Dict[str, float] = {}  # P's address -> its last answer (monotonic)
        self._next_probe = 0.0
        self._side_counts = SideChannelCounts()
        self.peers: Optional[List[dict]] = None  # per-rank peer_info, from the workers' handshakes
        # transfer id -> (request id, the blocks P fills), until P answered the post (the
        # poster thread appends answers to _answers; the engine thread makes RecvReqs)
        self._posting: Dict[str, Tuple[str, List[int], str]] = {}
        self._answers: "deque[Tuple[str, int]]" = deque()
        self._new: List[RecvReq] = []
        self._in_flight: Set[str] = set()  # P may still write into these requests' blocks
        # prompt tokens D computed itself per remote-prefilled request (reported back in
        # the output's kv_transfer_params: ~1 when the KV came from P, the whole prompt
        # when it was recomputed)
        self._local_prompt: Dict[str, Tuple["Request", int]] = {}
        self.kv_cache_manager: Optional["KVCacheManager"] = None
        self._post_failures_seen = 0
        self._remote: Dict[str, DecodeParams] = {}  # validated, until its blocks are allocated
        self._settled: Set[str] = set()  # posted or refused: never a second transfer
        self._errors: Dict[str, str] = {}  # request id -> why its params were refused
        # transfer id -> the live request on this instance that uses it: a second live
        # request with the same id would share one posting and never get its KV
        self._live_tids: Dict[str, str] = {}
        self._tid_of: Dict[str, str] = {}  # request id -> its entry in _live_tids
        self._bad_params = 0  # refused since the last stats

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[int, bool]:
        req_id = request.request_id
        if req_id in self._settled:  # its one transfer was posted, or refused
            return 0, False
        remote = self._remote.get(req_id)
        if remote is None:
            try:
                remote = decode_params(request.kv_transfer_params)
            except BadTransferParams as exc:
                return self._refuse_params(request, str(exc))
            if remote is None:
                return 0, False
            if self._live_tids.setdefault(remote.transfer_id, req_id) != req_id:
                return self._refuse_params(request, f"transfer_id {remote.transfer_id!r} is used by "
                                                    f"another live request on this decode instance")
            self._tid_of[req_id] = remote.transfer_id
            self._remote[req_id] = remote
        # The whole prompt comes from P; vLLM then recomputes the last prompt token to
        # sample the first output token (num_computed_tokens = prompt_len - 1).
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _refuse_params(self, request: "Request", why: str) -> Tuple[int, bool]:
        """The request computes its prompt locally; its output names ``why`` (kvops_error)."""
        log.error("request %s: %s; computing the prompt locally", request.request_id, why)
        self._settled.add(request.request_id)
        self._errors[request.request_id] = why
        self._local_prompt[request.request_id] = (request, 0)
        self._bad_params += 1
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        remote = self._remote.pop(request.request_id, None)
        if remote is None:
            return
        self._settled.add(request.request_id)  # one transfer per request
        if num_external_tokens == 0:
            return
        if self.peers is None:
            raise RuntimeError("the decode workers sent no handshake (peer_info)")
        tid = remote.transfer_id
        log.debug("request %s: decode blocks allocated at %.4f", request.request_id, time.monotonic())
        block_ids = list(self.kv_cache_manager.get_block_ids(request.request_id)[0])
        # tokens before this are local prefix-cache hits on D: P need not push them
        start_token = request.num_prompt_tokens - num_external_tokens
        self._posting[tid] = (request.request_id, block_ids[start_token // self.block_size:],
                              remote.post_to)
        self._in_flight.add(request.request_id)
        # P's side channel (host:port) or its bootstrap endpoint (http://host:port),
        # forwarded as the client gave it (validated by params.decode_params)
        self.poster.post(remote.post_to, {
            "transfer_id": tid, "block_ids": block_ids, "start_token": start_token,
            "peers": self.peers})
        self._local_prompt[request.request_id] = (request, 0)

    def _posted(self, tid: str, answer: Optional[dict]) -> None:
        """Poster thread: P accepted the destination (its answer) or never will (None)."""
        prefill_tp = 0
        if answer is not None:
            try:
                prefill_tp = int(answer.get("prefill_tp", 1))
            except (TypeError, ValueError):
                log.error("transfer %s: prefill side answered a bad prefill_tp: %r", tid, answer)
        self._answers.append((tid, prefill_tp))

    def _pending(self, address: str, pending: Optional[List[str]], silent: bool) -> None:
        """Poster thread: the transfers ``address`` still owes (None: no answer;
        ``silent``: the question timed out)."""
        self._pending_answers.append((address, pending, silent))

    def build_connector_meta(self, out: "SchedulerOutput", meta: KvopsConnectorMetadata) -> None:
        while self._answers:
            tid, prefill_tp = self._answers.popleft()
            posted = self._posting.pop(tid, None)
            if posted is not None:
                self._new.append(RecvReq(posted[0], tid, prefill_tp, posted[1]))
                if prefill_tp > 0:  # P accepted it: an answer, and a push owed
                    self._owed[tid] = (posted[0], posted[2])
                    self._answered_at[posted[2]] = time.monotonic()
        meta.recv, self._new = self._new, []
        self._renew_owed(meta)
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            entry = self._local_prompt.get(req_id)
            if entry is not None:
                req, computed = entry
                prompt_part = max(0, min(num_tokens, req.num_prompt_tokens - req.num_computed_tokens))
                self._local_prompt[req_id] = (req, computed + prompt_part)

    def _renew_owed(self, meta: KvopsConnectorMetadata) -> None:
        """Hand the workers the requests whose P answered it still owes their push (or
        was silent, but answered within the last lease), and ask again when a sixth of
        the lease has passed."""
        now = time.monotonic()
        while self._pending_answers:
            address, pending, silent = self._pending_answers.popleft()
            if pending is not None:
                self._answered_at[address] = now
            elif silent and now - self._answered_at.get(address, -self._lease_s) < self._lease_s:
                pending = [tid for tid, (_, producer) in self._owed.items() if producer == address]
            for tid in pending or ():
                owed = self._owed.get(tid)
                if owed is not None:
                    meta.renew.append(owed[0])
        if not self._owed or now < self._next_probe:
            return
        self._next_probe = now + self._probe_every_s
        by_producer: Dict[str, List[str]] = {}
        for tid, (_, producer) in self._owed.items():
            by_producer.setdefault(producer, []).append(tid)
        for address in [a for a in self._answered_at if a not in by_producer]:
            del self._answered_at[address]  # owed nothing: forgotten, so the table stays small
        for producer, tids in by_producer.items():
            self.poster.probe(producer, tids[:MAX_PROBED])  # P refuses a longer question

    def request_finished(self, request: "Request") -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        self._remote.pop(req_id, None)
        tid = self._tid_of.pop(req_id, None)
        if tid is not None:
            del self._live_tids[tid]
        self._settled.discard(req_id)
        entry = self._local_prompt.pop(req_id, None)
        params = None if entry is None else {"kvops_local_prompt_tokens": entry[1]}
        error = self._errors.pop(req_id, None)
        if error is not None:
            params["kvops_error"] = error
        # Finished (e.g. aborted) while P may still push into its blocks: keep them until
        # the worker reports the transfer over (finished_recving). Its lease bounds that:
        # nobody wants the KV any more, so it is not renewed.
        if req_id in self._in_flight:
            self._owed = {t: o for t, o in self._owed.items() if o[0] != req_id}
            return True, params
        return False, params

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        received = set(output.finished_recving or ())
        if received:
            self._in_flight -= received
            self._owed = {t: o for t, o in self._owed.items() if o[0] not in received}

    def connector_stats(self) -> Optional[KvopsConnectorStats]:
        counts = SchedulerCounts()
        failures = self.poster.failures  # counted by the poster threads
        if failures != self._post_failures_seen:
            counts.failure("post_to_prefill", failures - self._post_failures_seen)
        if self._bad_params:
            counts.failure("bad_transfer_params", self._bad_params)
        self._post_failures_seen, self._bad_params = failures, 0
        self._side_counts.update(counts, self.poster.counters(), "post_")
        return counts.take()

    def shutdown(self) -> None:
        self.poster.close()
