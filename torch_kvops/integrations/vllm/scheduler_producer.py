"""P's scheduler side: binds each request to the destination D posted for it, and
decides which blocks P pushes in each step.

Late binding (``late_binding``, the default): P schedules a request at once. Every
step, before the plan is handed to the workers, the destinations that arrived meanwhile
are bound; a bound request then pushes what is written by the end of the step:

- bound before its first chunk: each chunk pushes its blocks layer by layer as the
  forward writes them;
- bound between two chunks (or before its last step): the next step pushes the blocks
  written so far together with that step's chunk, layer by layer alongside the forward
  (one plan per step: a destination arriving during a step is bound at the next one);
- bound after P finished the request: P kept its blocks (``request_finished`` returned
  True) and the next step pushes all of them; when no request is scheduled, vLLM still
  runs a step without a forward, and the workers push every layer in ``wait_for_save``.

A finished request waits for its destination at most ``hold_for_decode_s``, at most
``max_held_requests`` wait, and together they keep at most ``max_held_pool_share`` of
P's KV blocks (64 long prompts must not starve new requests of blocks): over any
bound the oldest hold is released (the workers
report it in ``finished_sending`` so vLLM frees its blocks once; D recomputes when its
lease ends). ``wait_for_decode_s`` (0 by default with late binding) keeps a request
out of the schedule until its destination arrived, at most that long, so that a
D-first proxy gets every chunk pushed layer by layer. ``late_binding=False`` gives the
D-first protocol alone: after ``wait_for_decode_s`` the request is prefilled without
push.

Preemption: the scheduler frees a preempted request's blocks and computes it again
later; its pushes start again from D's first block with that recompute, so D ends with
the KV of the pass that completed the prompt (every chunk pushed before the preemption
had landed: a step's pushes end before the step does).

A destination block is named by one unfinished push at a time: D reuses a block only
after the request that had it ended on D, so when a new destination names a block an
unfinished push still names, that push is stale (D refuses it anyway) and ends here,
counted as ``stale_destination``; the step never names one decode block twice.

D's lease: the side channel answers D's liveness questions (server.py) with the
transfers P still owes, so D waits for a request queued, preempted or still pushing
here; the scheduler settles a transfer once the workers reported its pushes over
(``finished_sending``) or P gave it up.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from .metadata import KvopsConnectorMetadata, KvopsSettings, PushReq
from .metrics import SchedulerCounts
from .params import BadTransferParams, for_decode, prefill_params
from .side_channel.engine import SideChannelCounts, start_prefill_endpoints

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
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
    push_mode: str
    dst_blocks: Optional[List[int]] = None  # None until D's destination is bound
    peers: Optional[List[dict]] = None
    start_token: int = 0  # tokens before this are D's local prefix-cache hits: never pushed
    pushed_tokens: int = 0  # tokens before this were pushed already
    emitted: bool = False  # some chunk was handed to the worker
    done: bool = False  # the last chunk was handed to the worker (or it never will be)
    held_since: Optional[float] = None  # finished before its destination: blocks held
    src_blocks: Optional[List[int]] = None  # a held request's blocks, as it finished

    @property
    def bound(self) -> bool:
        return self.dst_blocks is not None


class ProducerScheduler:
    """P side: binds destinations as they arrive and plans per-step pushes."""

    def __init__(self, settings: KvopsSettings, block_size: int, tp_size: int = 1,
                 engine_id: str = "", dp_rank: int = 0) -> None:
        self.settings, self.block_size = settings, block_size
        # bootstrap: the GET /query endpoint (DP rank 0), or this rank's registration there
        self.server, self.bootstrap = start_prefill_endpoints(settings, tp_size, engine_id, dp_rank)
        self._side_counts = SideChannelCounts()
        self._waiting: Dict[str, float] = {}  # late binding off: req_id -> wait deadline
        self._no_push: Set[str] = set()
        self._pushes: Dict[str, _Push] = {}  # scheduled requests with a transfer
        self._held: "OrderedDict[str, _Push]" = OrderedDict()  # finished, unbound, oldest first
        self._held_blocks = 0  # the blocks the holds keep
        self._release: List[str] = []  # holds given up, for the next step's workers
        self._releasing: Set[str] = set()  # ... until the workers reported them
        self._awaiting_free: Set[str] = set()  # finished, blocks held until the push ends
        # (decode engine id, decode block) -> the unfinished bound push naming it
        self._dst_owner: Dict[Tuple[str, int], _Push] = {}
        self._settle_when_sent: Dict[str, str] = {}  # request id -> transfer id, pushed
        self.kv_cache_manager: Optional["KVCacheManager"] = None
        self.counts = SchedulerCounts()

    # ------------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> Tuple[Optional[int], bool]:
        req_id = request.request_id
        if req_id in self._pushes or req_id in self._no_push:
            return 0, False
        try:
            params = prefill_params(request.kv_transfer_params)
        except BadTransferParams as exc:
            log.error("request %s: bad kv_transfer_params (%s); prefilling without push", req_id, exc)
            self.counts.failure("bad_transfer_params")
            self._no_push.add(req_id)
            return 0, False
        if params is None:
            return 0, False
        push = _Push(request, params.transfer_id, params.push_mode or self.settings.push_mode)
        dest = self.server.take(params.transfer_id)
        if dest is not None:
            self._bind(push, dest)
        else:
            deadline = self._waiting.setdefault(req_id, time.monotonic() + self.settings.wait_for_decode_s)
            if time.monotonic() < deadline:
                return None, False  # the D-first wait: ask again next step; the engine goes on
            if not self.settings.late_binding:
                log.error("request %s (transfer %s): no decode destination within %.1f s; "
                          "prefilling without push", req_id, push.transfer_id,
                          self.settings.wait_for_decode_s)
                self._waiting.pop(req_id, None)
                self._no_push.add(req_id)
                self.server.settle(push.transfer_id)  # a later post is refused: D recomputes
                self.counts.failure("no_destination")
                return 0, False
        self._waiting.pop(req_id, None)
        self._pushes[req_id] = push
        return 0, False

    def _bind(self, push: _Push, dest: dict) -> None:
        log.debug("request %s: destination bound at %.4f", push.request.request_id, time.monotonic())
        push.dst_blocks, push.peers = dest["block_ids"], dest["peers"]
        push.start_token = push.pushed_tokens = int(dest["start_token"])
        engine = str(push.peers[0].get("engine_id"))
        for block in push.dst_blocks:
            stale = self._dst_owner.get((engine, block))
            if stale is not None and stale is not push:
                log.warning("request %s (transfer %s): decode block %d now belongs to transfer %s: "
                            "the decode side gave the request up; no more pushes",
                            stale.request.request_id, stale.transfer_id, block, push.transfer_id)
                self.counts.failure("stale_destination")
                self._end_push(stale)
            self._dst_owner[(engine, block)] = push

    def _end_push(self, push: _Push) -> None:
        """No more chunks of ``push`` will be planned: its decode blocks are free to be
        named by another push. P still owes D the chunks handed over until the workers
        report the request (``finished_sending``), when it is settled."""
        push.done = True
        if push.bound:
            engine = str(push.peers[0].get("engine_id"))
            for block in push.dst_blocks:
                if self._dst_owner.get((engine, block)) is push:
                    del self._dst_owner[(engine, block)]

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, out: "SchedulerOutput", meta: KvopsConnectorMetadata) -> None:
        for req_id in out.preempted_req_ids or ():
            push = self._pushes.get(req_id)
            if push is not None and push.bound and not push.done:
                # its blocks are freed; the recompute pushes the prompt again from the start
                push.pushed_tokens = push.start_token
                self.counts.count("preempted_repushes")
        for push in self._pushes.values():
            if not push.bound:
                dest = self.server.take(push.transfer_id)
                if dest is not None:
                    self._bind(push, dest)
        # Every destination is bound before any push is planned: a new destination that
        # names a decode block ends the stale push owning it (_bind), so no step plans
        # both.
        held = self._bind_held()
        for req_id, push in self._pushes.items():
            if push.bound and not push.done:
                req = push.request
                # written by the end of this step: computed before it, plus its chunk
                written = req.num_computed_tokens + out.num_scheduled_tokens.get(req_id, 0)
                self._plan(push, min(written, req.num_prompt_tokens), None, meta)
        self._push_held(held, meta)
        self._expire_holds(time.monotonic())
        meta.release, self._release = self._release, []

    def _plan(self, push: _Push, end: int, src: Optional[List[int]], meta: KvopsConnectorMetadata,
              finished: bool = False) -> None:
        """Push the blocks of tokens [pushed_tokens, end) from ``src`` (None: the
        request's blocks now); a block cut by a chunk boundary is pushed again with the
        next chunk, whole."""
        req = push.request
        prompt = req.num_prompt_tokens
        if end <= push.pushed_tokens and end < prompt:
            return
        if src is None:
            src = list(self.kv_cache_manager.get_block_ids(req.request_id)[0])
        first, last = push.pushed_tokens // self.block_size, _cdiv(end, self.block_size)
        if last > len(push.dst_blocks) or last > len(src):
            log.error("request %s: decode side gave %d blocks, %d needed; not pushing",
                      req.request_id, len(push.dst_blocks), last)
            self.counts.failure("too_few_decode_blocks")
            self._end_push(push)
            return
        push.pushed_tokens = end
        if end >= prompt:
            self._end_push(push)
        push.emitted = True
        base = push.start_token // self.block_size  # D's first block P fills
        meta.push.append(PushReq(req.request_id, push.transfer_id, push.peers, src[first:last],
                                 push.dst_blocks[first:last], push.done, push.push_mode, finished,
                                 block_offset=first - base, total_blocks=len(push.dst_blocks) - base))

    def _bind_held(self) -> List[Tuple[str, _Push]]:
        """Held requests whose destination arrived, bound (no longer held)."""
        bound = []
        for req_id, push in list(self._held.items()):
            dest = self.server.take(push.transfer_id)
            if dest is not None:
                self._unhold(req_id)
                self._bind(push, dest)
                bound.append((req_id, push))
        return bound

    def _unhold(self, req_id: str) -> None:
        push = self._held.pop(req_id)
        self._held_blocks -= len(push.src_blocks)

    def _push_held(self, held: List[Tuple[str, _Push]], meta: KvopsConnectorMetadata) -> None:
        """Held requests bound this step: every block at once."""
        for req_id, push in held:
            if push.done:  # a destination bound after it named one of its blocks
                self.server.settle(push.transfer_id)
                self._release.append(req_id)
                self._releasing.add(req_id)
                self.counts.count("held_change", -1)
                continue
            self._plan(push, push.request.num_prompt_tokens, push.src_blocks, meta, finished=True)
            self.counts.count("held_change", -1)
            if push.emitted:
                self.counts.count("holds_pushed")
                self._awaiting_free.add(req_id)  # the workers report it once pushed
                self._settle_when_sent[req_id] = push.transfer_id
            else:  # not pushable (too few decode blocks): free it through the workers
                self.server.settle(push.transfer_id)
                self._release.append(req_id)
                self._releasing.add(req_id)

    def _expire_holds(self, now: float) -> None:
        pool = self.kv_cache_manager.block_pool.num_gpu_blocks
        while self._held:
            req_id, push = next(iter(self._held.items()))
            if len(self._held) > self.settings.max_held_requests:
                cause, why = "hold_overflow", f"while {self.settings.max_held_requests} requests were held"
            elif self._held_blocks > self.settings.max_held_pool_share * pool:
                cause, why = "hold_pool_share", (f"while holds kept {self._held_blocks} of the "
                                                 f"{pool} KV blocks")
            elif now - push.held_since > self.settings.hold_for_decode_s:
                cause, why = "hold_expired", f"within {self.settings.hold_for_decode_s:.1f} s"
            else:
                return
            self._unhold(req_id)
            log.warning("request %s (transfer %s): no decode destination %s; its blocks are "
                        "freed (the decode side recomputes)", req_id, push.transfer_id, why)
            self.counts.failure(cause)
            self.counts.count("held_change", -1)
            self.server.settle(push.transfer_id)
            self._release.append(req_id)
            self._releasing.add(req_id)

    # ------------------------------------------------------------------ completion

    def request_finished(self, request: "Request") -> Tuple[bool, Optional[Dict[str, Any]]]:
        req_id = request.request_id
        self._waiting.pop(req_id, None)
        self._no_push.discard(req_id)
        push = self._pushes.pop(req_id, None)
        if push is None:
            self._settle_unadmitted(request)
            return False, None
        answer = for_decode(push.transfer_id, self.server.address)  # for nixl-mode routers
        if push.emitted:
            self._end_push(push)  # done, or aborted before its last chunk
            # The worker reports it in finished_sending once its last push returned;
            # until then D's liveness questions hear that P still owes it.
            self._awaiting_free.add(req_id)
            self._settle_when_sent[req_id] = push.transfer_id
            return True, answer
        prefilled = request.num_computed_tokens >= request.num_prompt_tokens
        if (self.settings.late_binding and not push.bound and not push.done and prefilled
                and self.settings.max_held_requests > 0):
            push.held_since = time.monotonic()
            push.src_blocks = list(self.kv_cache_manager.get_block_ids(req_id)[0])
            self._held[req_id] = push
            self._held_blocks += len(push.src_blocks)
            self.counts.count("holds")
            self.counts.count("held_change", 1)
            self._expire_holds(push.held_since)  # the count bound, at once
            return True, answer
        self._end_push(push)
        self.server.settle(push.transfer_id)  # never pushed: nothing more will be
        return False, answer

    def _settle_unadmitted(self, request: "Request") -> None:
        """A request finished (aborted) before the scheduler admitted it, or one that
        was prefilled without push: P will never push it."""
        try:
            params = prefill_params(request.kv_transfer_params)
        except BadTransferParams:
            return  # refused at admission already, or never admitted: no transfer id to trust
        if params is not None:
            self.server.settle(params.transfer_id)

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        sending = set(output.finished_sending or ())
        self._awaiting_free -= sending
        self._releasing -= sending
        for req_id in sending:
            tid = self._settle_when_sent.pop(req_id, None)
            if tid is not None:
                self.server.settle(tid)

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting_free or self._held or self._releasing)

    @property
    def held(self) -> int:
        """Finished requests whose blocks wait for their destination."""
        return len(self._held)

    def connector_stats(self):
        """Scheduler-side counts since the last call (metrics.py), or None."""
        self._side_counts.update(self.counts, self.server.counters(), "")
        return self.counts.take()

    def shutdown(self) -> None:
        try:
            if self.bootstrap is not None:
                self.bootstrap.close()
        finally:
            self.server.close()
