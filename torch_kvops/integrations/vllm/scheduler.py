"""Scheduler side: pairs a request across the prefill (P) and decode (D) engines and
decides which blocks P pushes in each step.

Protocol (docs/vllm.md): the proxy sends the request to D with
``{"do_remote_prefill": true, "transfer_id": T, "kvops_producer": "host:port"}`` and to
P with ``{"do_remote_decode": true, "transfer_id": T}``. D reports the whole prompt
as an asynchronous external hit, allocates its blocks, and posts ``{T, block ids,
per-rank peer_info}`` to P's side channel, which answers with P's tensor-parallel size
(each D rank then knows which parts of T it receives: tp.py). P does not schedule the request until that
destination arrived (``get_num_new_matched_tokens`` answers None, so the scheduler
asks again next step without blocking), at most ``wait_for_decode_s``; then every
prefill chunk pushes the blocks it wrote into D's blocks at the same positions.

Preemption (P): the scheduler frees a preempted request's blocks and computes it again
later; its pushes start again from D's first block with that recompute, so D ends with
the KV of the pass that completed the prompt. Every chunk pushed before the preemption
had landed (a step's pushes end before the step does), and the transfer stays open on
D meanwhile (its lease bounds the wait: if it expires, D keeps what landed, recomputes
the rest, and P's later chunks are refused, so each side still reports it once).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from .metadata import PUSH_MODES, KvopsConnectorMetadata, KvopsSettings, PushReq, RecvReq
from .metrics import FAILURE_PREFIX, KvopsConnectorStats
from .side_channel import DestinationPoster, DestinationServer

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Push:
    request: "Request"
    transfer_id: str
    dst_blocks: List[int]
    peers: List[dict]
    start_token: int  # tokens before this are D's local prefix-cache hits: never pushed
    pushed_tokens: int  # tokens before this were pushed already
    push_mode: str
    emitted: bool = False  # some chunk was handed to the worker
    done: bool = False  # the last chunk was handed to the worker


class _SchedulerCounts:
    """Scheduler-side events (failures by cause, re-pushes after a preemption), handed
    to vLLM's stats once (metrics.py)."""

    def __init__(self) -> None:
        self._counts: Dict[str, int] = {}

    def failure(self, cause: str) -> None:
        self.count(FAILURE_PREFIX + cause)

    def count(self, key: str, n: int = 1) -> None:
        self._counts[key] = self._counts.get(key, 0) + n

    def take(self) -> Optional[KvopsConnectorStats]:
        if not self._counts:
            return None
        stats = KvopsConnectorStats()
        stats.data.update(self._counts)
        self._counts = {}
        return stats


class ProducerScheduler:
    """P side: waits for each request's destination, then plans per-chunk pushes."""

    def __init__(self, settings: KvopsSettings, block_size: int, tp_size: int = 1) -> None:
        self.settings, self.block_size = settings, block_size
        self.server = DestinationServer(settings.side_channel_host, settings.side_channel_port,
                                        facts={"prefill_tp": tp_size})
        self._waiting: Dict[str, float] = {}  # req_id -> deadline for its destination
        self._no_push: Set[str] = set()
        self._pushes: Dict[str, _Push] = {}
        self._awaiting_free: Set[str] = set()  # finished, blocks held until the push ends
        self.kv_cache_manager: Optional["KVCacheManager"] = None
        self.counts = _SchedulerCounts()

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        params = request.kv_transfer_params or {}
        req_id = request.request_id
        if not params.get("do_remote_decode") or req_id in self._pushes or req_id in self._no_push:
            return 0, False
        if "transfer_id" not in params:
            log.error("request %s: do_remote_decode without transfer_id; prefilling without push",
                      req_id)
            self._no_push.add(req_id)
            return 0, False
        tid = str(params["transfer_id"])
        dest = self.server.take(tid)
        if dest is None:
            deadline = self._waiting.setdefault(req_id, time.monotonic() + self.settings.wait_for_decode_s)
            if time.monotonic() < deadline:
                return None, False  # ask again next step; the engine loop goes on
            log.error("request %s (transfer %s): no decode destination within %.1f s; "
                      "prefilling without push", req_id, tid, self.settings.wait_for_decode_s)
            self._waiting.pop(req_id, None)
            self._no_push.add(req_id)
            self.counts.failure("no_destination")
            return 0, False
        self._waiting.pop(req_id, None)
        log.debug("request %s: destination taken at %.4f", req_id, time.monotonic())
        mode = str(params.get("kvops_push_mode", self.settings.push_mode))
        if mode not in PUSH_MODES:
            raise ValueError(f"request {req_id}: kvops_push_mode must be one of {PUSH_MODES}")
        start = int(dest["start_token"])
        self._pushes[req_id] = _Push(request, tid, dest["block_ids"], dest["peers"], start_token=start,
                                     pushed_tokens=start, push_mode=mode)
        return 0, False

    def build_connector_meta(self, out: "SchedulerOutput", meta: KvopsConnectorMetadata) -> None:
        for req_id in out.preempted_req_ids or ():
            push = self._pushes.get(req_id)
            if push is not None and not push.done:
                # its blocks are freed; the recompute pushes the prompt again from the start
                push.pushed_tokens = push.start_token
                self.counts.count("preempted_repushes")
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            push = self._pushes.get(req_id)
            if push is None or push.done:
                continue
            req = push.request
            prompt = req.num_prompt_tokens
            end = min(req.num_computed_tokens + num_tokens, prompt)
            if end <= push.pushed_tokens and end < prompt:
                continue
            # A block cut by a chunk boundary is pushed again with the next chunk, whole.
            first, last = push.pushed_tokens // self.block_size, _cdiv(end, self.block_size)
            src = list(self.kv_cache_manager.get_block_ids(req_id)[0])
            if last > len(push.dst_blocks) or last > len(src):
                log.error("request %s: decode side gave %d blocks, %d needed; not pushing",
                          req_id, len(push.dst_blocks), last)
                self.counts.failure("too_few_decode_blocks")
                push.done = True
                continue
            push.pushed_tokens = end
            push.done = end >= prompt
            push.emitted = True
            base = push.start_token // self.block_size  # D's first block P fills
            meta.push.append(PushReq(req_id, push.transfer_id, push.peers, src[first:last],
                                     push.dst_blocks[first:last], push.done, push.push_mode,
                                     block_offset=first - base, total_blocks=len(push.dst_blocks) - base))

    def request_finished(self, request: "Request") -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        self._waiting.pop(req_id, None)
        self._no_push.discard(req_id)
        push = self._pushes.pop(req_id, None)
        if push is None or not push.emitted:
            return False, None
        # The worker reports it in finished_sending once its last push returned.
        self._awaiting_free.add(req_id)
        return True, None

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        self._awaiting_free -= set(output.finished_sending or ())

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting_free)

    def connector_stats(self) -> Optional[KvopsConnectorStats]:
        return self.counts.take()

    def shutdown(self) -> None:
        self.server.close()


class ConsumerScheduler:
    """D side: claims the prompt as an asynchronous external hit, allocates, and posts
    the destination to the request's prefill side."""

    def __init__(self, settings: KvopsSettings, block_size: int) -> None:
        self.settings, self.block_size = settings, block_size
        self.poster = DestinationPoster(self._posted, settings.post_timeout_s, settings.post_retries)
        self.peers: Optional[List[dict]] = None  # per-rank peer_info, from the workers' handshakes
        # transfer id -> (request id, the blocks P fills), until P answered the post (the
        # poster thread appends answers to _answers; the engine thread makes RecvReqs)
        self._posting: Dict[str, Tuple[str, List[int]]] = {}
        self._answers: "deque[Tuple[str, int]]" = deque()
        self._new: List[RecvReq] = []
        self._in_flight: Set[str] = set()  # P may still write into these requests' blocks
        # prompt tokens D computed itself per remote-prefilled request (reported back in
        # the output's kv_transfer_params: ~1 when the KV came from P, the whole prompt
        # when it was recomputed)
        self._local_prompt: Dict[str, Tuple["Request", int]] = {}
        self.kv_cache_manager: Optional["KVCacheManager"] = None
        self._post_failures_seen = 0

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        if "transfer_id" not in params or "kvops_producer" not in params:
            log.error("request %s: do_remote_prefill needs transfer_id and kvops_producer; "
                      "computing the prompt locally", request.request_id)
            params["do_remote_prefill"] = False
            return 0, False
        # The whole prompt comes from P; vLLM then recomputes the last prompt token to
        # sample the first output token (num_computed_tokens = prompt_len - 1).
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens == 0:
            return
        if self.peers is None:
            raise RuntimeError("the decode workers sent no handshake (peer_info)")
        tid = str(params["transfer_id"])
        log.debug("request %s: decode blocks allocated at %.4f", request.request_id, time.monotonic())
        block_ids = list(self.kv_cache_manager.get_block_ids(request.request_id)[0])
        # tokens before this are local prefix-cache hits on D: P need not push them
        start_token = request.num_prompt_tokens - num_external_tokens
        self._posting[tid] = (request.request_id, block_ids[start_token // self.block_size:])
        self._in_flight.add(request.request_id)
        self.poster.post(str(params["kvops_producer"]), {
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

    def build_connector_meta(self, out: "SchedulerOutput", meta: KvopsConnectorMetadata) -> None:
        while self._answers:
            tid, prefill_tp = self._answers.popleft()
            posted = self._posting.pop(tid, None)
            if posted is not None:
                self._new.append(RecvReq(posted[0], tid, prefill_tp, posted[1]))
        meta.recv, self._new = self._new, []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            entry = self._local_prompt.get(req_id)
            if entry is not None:
                req, computed = entry
                prompt_part = max(0, min(num_tokens, req.num_prompt_tokens - req.num_computed_tokens))
                self._local_prompt[req_id] = (req, computed + prompt_part)

    def request_finished(self, request: "Request") -> Tuple[bool, Optional[Dict[str, Any]]]:
        entry = self._local_prompt.pop(request.request_id, None)
        params = None if entry is None else {"kvops_local_prompt_tokens": entry[1]}
        # Finished (e.g. aborted) while P may still push into its blocks: keep them until
        # the worker reports the transfer over (finished_recving; its lease bounds it).
        return request.request_id in self._in_flight, params

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        self._in_flight -= set(output.finished_recving or ())

    def connector_stats(self) -> Optional[KvopsConnectorStats]:
        failures = self.poster.failures  # counted by the poster thread
        if failures == self._post_failures_seen:
            return None
        stats = KvopsConnectorStats()
        stats.data[FAILURE_PREFIX + "post_to_prefill"] = failures - self._post_failures_seen
        self._post_failures_seen = failures
        return stats

    def shutdown(self) -> None:
        self.poster.close()
