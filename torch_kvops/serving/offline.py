"""In-process vLLM engines driven step by step, for tests and benchmarks of P/D.

Each :class:`Engine` is a spawned process running one ``LLM`` engine (its engine core in
the same process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) fed over a pipe: submit token-id
prompts, wait for results, read the KV of a request (:func:`compare_kv`), connector
stats and metrics, drain, abort, stop. :func:`disaggregated_request` sends a request the
way a P/D proxy does. ``python -m torch_kvops.serving.pd_compare`` (and
examples/vllm_disagg.py) runs the whole P/D comparison on these engines; the servers of
``vllm serve`` are in :mod:`torch_kvops.serving.servers`.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections import OrderedDict
from typing import Dict, List, Optional

from .ports import free_port  # noqa: F401  (re-exported: tests and runs pick ports with it)

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core runs in our driver process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per engine; the model is tiny
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # three engines share the machine's cores
    "TOKENIZERS_PARALLELISM": "false",
}


# An engine step shorter than this that returned nothing was an idle poll (waiting for
# remote KV or a destination); the pause after it doubles up to the maximum.
IDLE_STEP_S = 0.003
IDLE_SLEEP_MIN_S, IDLE_SLEEP_MAX_S = 0.001, 0.008


def run_engine_setup(spec: Optional[str]) -> None:
    """``module:function`` called in an engine process before its engine starts
    (instrumentation, or a test's fault injection); the function gets the process name."""
    if spec:
        import importlib
        module, _, func = spec.partition(":")
        getattr(importlib.import_module(module), func)(mp.current_process().name)


def engine_main(pipe, engine_kwargs: dict, setup: Optional[str] = None) -> None:
    """Driver process: one in-process vLLM engine, fed over a pipe."""
    os.environ.update(ENGINE_ENV)
    import logging
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("(%(processName)s) %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("torch_kvops").addHandler(handler)
    logging.getLogger("torch_kvops").setLevel(os.environ.get("KVOPS_LOG_LEVEL", "WARNING"))
    try:
        run_engine_setup(setup)
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        from torch_kvops.integrations.vllm import probes

        kwargs = dict(engine_kwargs)
        if kwargs.get("kv_transfer_config"):
            kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
        engine = LLM(**kwargs).llm_engine
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise
    pipe.send(("ready", None))
    scheduler = engine.engine_core.engine_core.scheduler
    # block ids of recent requests, noted when the scheduler hands them out: for "kv",
    # the blocks of a finished request keep their bytes until another request reuses
    # them (a request can be scheduled and finish within one step)
    blocks_of: "OrderedDict[str, List[int]]" = OrderedDict()
    schedule = scheduler.schedule

    def schedule_and_note_blocks(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for request in scheduler.requests.values():
            ids = scheduler.kv_cache_manager.get_block_ids(request.request_id)[0]
            if ids:
                # vLLM appends "-" and 8 random characters to the id it was given
                blocks_of[request.request_id[:-9]] = list(ids)
                blocks_of.move_to_end(request.request_id[:-9])
        while len(blocks_of) > 64:
            blocks_of.popitem(last=False)
        return out

    scheduler.schedule = schedule_and_note_blocks

    def busy() -> bool:
        # like vLLM's engine-core loop: keep stepping while the connector still has push
        # work (finished requests whose blocks wait for the push's acknowledgement)
        return engine.has_unfinished_requests() or scheduler.has_requests()

    first: Dict[str, float] = {}
    preemptions: Dict[str, int] = {}  # times the scheduler preempted a running request
    drain_deadline: Optional[float] = None
    idle_sleep = IDLE_SLEEP_MIN_S
    try:
        while True:
            if drain_deadline is not None and (not busy() or time.monotonic() > drain_deadline):
                pool = scheduler.kv_cache_manager.block_pool
                pipe.send(("drained", {"idle": not busy(),
                                       "free_blocks": pool.get_num_free_blocks(),
                                       "usable_blocks": pool.num_gpu_blocks - 1}))  # - null block
                drain_deadline = None
            timeout = 0.0 if busy() else 0.05
            while pipe.poll(timeout):
                cmd, *args = pipe.recv()
                timeout = 0.0
                if cmd == "drain":  # answer once every request and delayed free is done
                    drain_deadline = time.monotonic() + args[0]
                    continue
                if cmd == "kv":  # ("kv", req_id, num_tokens): the whole KV, all ranks merged
                    ids = blocks_of.get(args[0])
                    pipe.send(("kv", None if ids is None else
                               probes.merge_ranks(engine.collective_rpc(probes.worker_kv,
                                                                        args=(ids, args[1])))))
                    continue
                if cmd == "stats":  # per rank
                    pipe.send(("stats", engine.collective_rpc(probes.worker_stats)))
                    continue
                if cmd == "worker_pids":
                    pipe.send(("worker_pids", engine.collective_rpc(probes.worker_pid)))
                    continue
                if cmd == "progress":  # ("progress", req_id): its output tokens so far, or None
                    req = next((r for r in scheduler.requests.values()
                                if r.request_id[:-9] == args[0]), None)
                    pipe.send(("progress", None if req is None else req.num_output_tokens))
                    continue
                if cmd == "abort":  # ("abort", req_id): the engine drops the request
                    engine.abort_request([args[0]])
                    pipe.send(("abort", None))
                    continue
                if cmd == "metrics":  # this engine's vllm:kvops_* Prometheus metrics
                    pipe.send(("metrics", kvops_metrics(engine)))
                    continue
                if cmd == "stop":
                    engine.engine_core.shutdown()  # closes the KV connector (threads, memory)
                    pipe.send(("stopped", None))
                    return
                for req_id, tokens, max_tokens, params in args[0]:
                    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                              detokenize=False,
                                              extra_args={"kv_transfer_params": params} if params else None)
                    engine.add_request(req_id, {"prompt_token_ids": tokens}, sampling)
            if not busy():
                continue
            for request in scheduler.requests.values():
                if request.num_preemptions:
                    preemptions[request.request_id[:-9]] = request.num_preemptions
            step_started = time.monotonic()
            outputs = engine.step()
            now = time.monotonic()
            for out in outputs:
                if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = now
                if out.finished:
                    pipe.send(("done", out.request_id, {
                        "tokens": list(out.outputs[0].token_ids),
                        "t_first": first.pop(out.request_id, now), "t_done": now,
                        "num_cached_tokens": out.num_cached_tokens,
                        "kv_transfer_params": out.kv_transfer_params,
                        "prompt_len": len(out.prompt_token_ids or []),
                        "finish_reason": out.outputs[0].finish_reason,
                        "num_preemptions": preemptions.pop(out.request_id, 0),
                        # rank 0's push steps (prefill side)
                        "kvops_steps": engine.collective_rpc(probes.worker_steps,
                                                             args=(out.request_id,))[0]}))
            if outputs or now - step_started > IDLE_STEP_S:
                idle_sleep = IDLE_SLEEP_MIN_S  # the step did work (a prefill chunk, a token)
            else:
                # Waiting for remote KV: vLLM steps in a busy loop, which here would take
                # a core from P (P and D share this machine's two cores; measured: D's
                # loop with a 2 ms pause used ~35% of a core while P prefilled). Back off
                # to at most IDLE_SLEEP_MAX_S, which bounds what it adds to D's TTFT.
                time.sleep(idle_sleep)
                idle_sleep = min(2 * idle_sleep, IDLE_SLEEP_MAX_S)
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise


def kvops_metrics(engine) -> dict:
    """The connector's metrics as the engine exports them (needs disable_log_stats=False):
    counters and gauges as numbers, histograms as {count, sum}; labelled ones as
    name{label=value}."""
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram

    out = {}
    for metric in engine.get_metrics():
        if not metric.name.startswith("vllm:kvops_"):
            continue
        extra = {k: v for k, v in metric.labels.items() if k not in ("model_name", "engine")}
        name = metric.name + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))
        if isinstance(metric, (Counter, Gauge)):
            out[name] = metric.value
        elif isinstance(metric, Histogram):
            out[name] = {"count": metric.count, "sum": metric.sum}
    return out


class Engine:
    """Parent-side handle; every wait is bounded."""

    def __init__(self, name: str, engine_kwargs: dict, setup: Optional[str] = None) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, engine_kwargs, setup), name=name)
        self.proc.start()
        self.results: Dict[str, dict] = {}

    def wait_ready(self, timeout: float) -> None:
        kind, value = self._recv(timeout)
        if kind != "ready":
            raise RuntimeError(f"{self.name} did not start: {kind} {value}")

    def _recv(self, timeout: float):
        if not self.pipe.poll(timeout):
            raise TimeoutError(f"{self.name}: no message within {timeout} s")
        kind, *rest = self.pipe.recv()
        if kind == "error":
            raise RuntimeError(f"{self.name} failed:\n{rest[0]}")
        return kind, rest

    def ask(self, kind: str, *args, timeout: float = 120.0):
        """Send ("kind", *args) and return the answer of that kind (results that
        arrive meanwhile are kept for wait_done)."""
        self.pipe.send((kind, *args))
        deadline = time.monotonic() + timeout
        while True:
            got, rest = self._recv(max(0.0, deadline - time.monotonic()))
            if got == kind:
                return rest[0]
            if got == "done":
                self.results[rest[0]] = rest[1]

    def submit(self, requests: list) -> None:
        self.pipe.send(("submit", requests))

    def wait_done(self, req_id: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while req_id not in self.results:
            kind, rest = self._recv(max(0.0, deadline - time.monotonic()))
            if kind == "done":
                self.results[rest[0]] = rest[1]
        return self.results.pop(req_id)

    def drain(self, timeout: float) -> dict:
        """Wait until the engine has no request and no pending block free."""
        self.pipe.send(("drain", timeout))
        deadline = time.monotonic() + timeout + 30
        while True:
            kind, rest = self._recv(max(0.0, deadline - time.monotonic()))
            if kind == "drained":
                return rest[0]
            if kind == "done":
                self.results[rest[0]] = rest[1]

    def metrics(self, timeout: float = 60.0) -> dict:
        """The engine's vllm:kvops_* metrics (needs --metrics: log stats on)."""
        return self.ask("metrics", timeout=timeout)

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.is_alive():
            try:
                self.pipe.send(("stop",))
                deadline = time.monotonic() + timeout
                while self.proc.is_alive() and time.monotonic() < deadline:
                    if self.pipe.poll(0.1):
                        kind, *_ = self.pipe.recv()
                        if kind == "stopped":
                            break
            except (BrokenPipeError, EOFError, ConnectionError) as exc:
                print(f"[{self.name}] pipe closed while stopping: {exc}", file=sys.stderr)
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
            raise RuntimeError(f"{self.name} did not stop within {timeout} s (killed)")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(30)


def stop_engines(engines: "List[Engine]") -> List[str]:
    """Stop every engine (each is tried even if another fails); the problems met."""
    problems = []
    for engine in engines:
        try:
            engine.stop()
        except (RuntimeError, OSError) as exc:
            problems.append(f"{engine.name}: {exc}")
    return problems


def tensor_parallel(size: int) -> dict:
    """Engine arguments for ``size`` tensor-parallel ranks (worker processes when > 1)."""
    return {} if size == 1 else {"tensor_parallel_size": size, "distributed_executor_backend": "mp"}


def local_prompt_tokens(out: dict) -> int:
    """Prompt tokens D computed itself, as its connector reports them."""
    params = out.get("kv_transfer_params") or {}
    if "kvops_local_prompt_tokens" not in params:
        raise RuntimeError(f"decode output carries no kvops_local_prompt_tokens: {params}")
    return int(params["kvops_local_prompt_tokens"])


def disaggregated_request(prefill: "Engine", decode: "Engine", tid: str, prompt: List[int],
                          new_tokens: int, producer_addr: str, mode: Optional[str] = None,
                          timeout: float = 300.0) -> tuple:
    """One request the way a P/D proxy sends it: to D first (it allocates blocks and
    posts them to P's side channel), then to P with one output token. Returns (D's
    output with "tid", "sent" and "ttft" added, P's output)."""
    sent = time.monotonic()
    decode.submit([(tid, prompt, new_tokens, {
        "do_remote_prefill": True, "transfer_id": tid, "kvops_producer": producer_addr})])
    params = {"do_remote_decode": True, "transfer_id": tid}
    if mode is not None:
        params["kvops_push_mode"] = mode
    prefill.submit([(tid, prompt, 1, params)])
    out = decode.wait_done(tid, timeout)
    prefill_out = prefill.wait_done(tid, timeout)
    out.update(tid=tid, sent=sent, ttft=out["t_first"] - sent)
    if os.environ.get("KVOPS_LOG_LEVEL") == "DEBUG":
        print(f"[proxy] {tid} sent {sent:.4f} P first {prefill_out['t_first']:.4f} "
              f"D first {out['t_first']:.4f}", file=sys.stderr)
    return out, prefill_out


def first_kv_difference(p_kv: list, d_kv: list) -> Optional[dict]:
    """The first (layer, block index in the request) whose bytes differ, or None."""
    if len(p_kv) != len(d_kv):
        return {"layer": None, "reason": f"{len(p_kv)} layers on P, {len(d_kv)} on D"}
    for layer, (p_blocks, d_blocks) in enumerate(zip(p_kv, d_kv)):
        if len(p_blocks) != len(d_blocks):
            return {"layer": layer, "reason": f"{len(p_blocks)} blocks on P, {len(d_blocks)} on D"}
        for j, (a, b) in enumerate(zip(p_blocks, d_blocks)):
            if a.shape != b.shape or a.tobytes() != b.tobytes():
                return {"layer": layer, "block": j}
    return None


def compare_kv(prefill: "Engine", decode: "Engine", tid: str, prompt_len: int) -> dict:
    """D's KV of request ``tid`` against P's, over the prompt tokens D received (all
    but the last, which D computes itself). Ask right after the request finished:
    its blocks keep their bytes only until the engine reuses them."""
    p_kv = prefill.ask("kv", tid, prompt_len - 1)
    d_kv = decode.ask("kv", tid, prompt_len - 1)
    if p_kv is None or d_kv is None:
        raise RuntimeError(f"{tid}: no block ids recorded on {'P' if p_kv is None else 'D'}")
    diff = first_kv_difference(p_kv, d_kv)
    return {"transfer_id": tid, "prompt_len": prompt_len, "match": diff is None, "first_difference": diff}


def spread(values: List[float]) -> dict:
    return {"median": round(statistics.median(values), 5), "min": round(min(values), 5),
            "max": round(max(values), 5), "n": len(values)}
