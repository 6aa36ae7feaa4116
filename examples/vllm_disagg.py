"""Prefill/decode disaggregation with two real vLLM engines and KvopsLayerwiseConnector.

Starts three engine processes on a tiny Llama (dummy weights, seeded, so all three
hold the same weights): P (kv_producer), D (kv_consumer, kv_load_failure_policy
"recompute") and a monolithic reference. This process plays the proxy: for each prompt
it sends the request to D (do_remote_prefill) and then to P (do_remote_decode, one
token), and takes the output from D. Each prompt runs in every mode (monolithic, P/D
layer-wise, P/D push-after-forward) in interleaved rounds; TTFT is measured from the
proxy's send to the first token (CLOCK_MONOTONIC is shared by the processes).
Optionally (--kill-prefill) P is killed in the middle of a chunked prefill and D's
outcome is recorded. The last line printed is one JSON object.

    python examples/vllm_disagg.py --prompt-lens 33,700,1500 --max-num-batched-tokens 256

``--link 1gbit`` runs all of it inside a network namespace whose loopback is shaped to
that rate (torch_kvops/emulated_link.py, needs root): the script re-runs itself there,
so P's pushes, the control channel and the side channel cross the emulated link.
``--model DIR`` loads a checkpoint (e.g. torch_kvops.testing.hf_model's context-sensitive
Llama) instead of the dummy-weight model.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Optional

import multiprocessing as mp

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


def write_model(directory: str, layers: int, hidden: int, vocab: int, max_len: int) -> None:
    heads = max(1, hidden // 64)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
        "vocab_size": vocab, "max_position_embeddings": max_len, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def engine_main(pipe, engine_kwargs: dict) -> None:
    """Driver process: one in-process vLLM engine, fed over a pipe."""
    os.environ.update(ENGINE_ENV)
    import logging
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("(%(processName)s) %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("torch_kvops").addHandler(handler)
    logging.getLogger("torch_kvops").setLevel(os.environ.get("KVOPS_LOG_LEVEL", "WARNING"))
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kwargs = dict(engine_kwargs)
        if kwargs.get("kv_transfer_config"):
            kwargs["kv_transfer_config"] = KVTransferConfig(**kwargs["kv_transfer_config"])
        engine = LLM(**kwargs).llm_engine
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
        raise
    pipe.send(("ready", None))
    scheduler = engine.engine_core.engine_core.scheduler

    def busy() -> bool:
        # like vLLM's engine-core loop: keep stepping while the connector still has push
        # work (finished requests whose blocks wait for the push's acknowledgement)
        return engine.has_unfinished_requests() or scheduler.has_requests()

    first: Dict[str, float] = {}
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
                        "kvops_steps": kvops_steps(out.request_id)}))
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
    counters as numbers, histograms as {count, sum}; labelled ones as name{label=value}."""
    from vllm.v1.metrics.reader import Counter, Histogram

    out = {}
    for metric in engine.get_metrics():
        if not metric.name.startswith("vllm:kvops_"):
            continue
        extra = {k: v for k, v in metric.labels.items() if k not in ("model_name", "engine")}
        name = metric.name + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))
        if isinstance(metric, Counter):
            out[name] = metric.value
        elif isinstance(metric, Histogram):
            out[name] = {"count": metric.count, "sum": metric.sum}
    return out


def kvops_steps(req_id: str) -> list:
    """Push-step timings of the in-process prefill worker (empty elsewhere)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    connector = get_kv_transfer_group()
    return connector.recent_steps(req_id) if hasattr(connector, "recent_steps") else []


class Engine:
    """Parent-side handle; every wait is bounded."""

    def __init__(self, name: str, engine_kwargs: dict) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.pipe, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(child, engine_kwargs), name=name)
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
        self.pipe.send(("metrics",))
        deadline = time.monotonic() + timeout
        while True:
            kind, rest = self._recv(max(0.0, deadline - time.monotonic()))
            if kind == "metrics":
                return rest[0]
            if kind == "done":
                self.results[rest[0]] = rest[1]

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_prompt_tokens(out: dict) -> int:
    """Prompt tokens D computed itself, as its connector reports them."""
    params = out.get("kv_transfer_params") or {}
    if "kvops_local_prompt_tokens" not in params:
        raise RuntimeError(f"decode output carries no kvops_local_prompt_tokens: {params}")
    return int(params["kvops_local_prompt_tokens"])


def spread(values: List[float]) -> dict:
    return {"median": round(statistics.median(values), 5), "min": round(min(values), 5),
            "max": round(max(values), 5), "n": len(values)}


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", default="33,700,1500")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=32, help="CPU attention needs a multiple of 32")
    ap.add_argument("--rounds", type=int, default=1, help="TTFT rounds per prompt and mode")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="rounds run first and not timed (first requests pay one-off costs)")
    ap.add_argument("--modes", default="layerwise,after_forward",
                    help="P/D push modes to run (the first one is checked for tokens)")
    ap.add_argument("--lease-s", type=float, default=6.0, help="D gives up on a silent P after this")
    ap.add_argument("--kill-prefill", action="store_true",
                    help="finally kill P in the middle of the longest prompt's prefill")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--records", action="store_true", help="include every timed request in the JSON")
    ap.add_argument("--link", metavar="RATE[,DELAY]",
                    help="run inside an emulated link, e.g. 1gbit (network namespace; needs root)")
    ap.add_argument("--link-timeout", type=float, default=4 * 3600.0,
                    help="bound of the whole run inside the link, seconds")
    ap.add_argument("--metrics", action="store_true",
                    help="P and D log stats; report their vllm:kvops_* metrics (P's before --kill-prefill)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per engine (OMP_NUM_THREADS; default: the engines' own)")
    ap.add_argument("--model", metavar="DIR",
                    help="checkpoint directory (loaded with vLLM's default format); "
                         "--layers/--hidden/--vocab then come from its config.json")
    args = ap.parse_args(argv)
    link = None
    if args.link:
        from torch_kvops.emulated_link import enter_link

        link = enter_link(args.link, [sys.executable, os.path.abspath(__file__),
                                      *(sys.argv[1:] if argv is None else argv)], args.link_timeout)

    lens = [int(x) for x in args.prompt_lens.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    max_len = max(lens) + args.new_tokens + 16
    tmp = tempfile.TemporaryDirectory(prefix="kvops-vllm-")
    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            config = json.load(f)
        args.layers, args.hidden, args.vocab = (config["num_hidden_layers"], config["hidden_size"],
                                                config["vocab_size"])
        model = dict(model=args.model)
    else:
        write_model(tmp.name, args.layers, args.hidden, args.vocab, max_len)
        model = dict(model=tmp.name, load_format="dummy")
        with open(os.path.join(tmp.name, "config.json")) as f:
            config = json.load(f)
    # one block of KV over all layers (float32 K and V), for the bytes the metrics count
    kv_block_bytes = (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
                      * config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
                      * args.block_size * 4)
    base = dict(model, skip_tokenizer_init=True, enforce_eager=True,
                seed=0, dtype="float32", max_model_len=max_len, block_size=args.block_size,
                max_num_batched_tokens=args.max_num_batched_tokens, enable_chunked_prefill=True,
                enable_prefix_caching=False, max_num_seqs=8)
    side_port = free_port()
    kvops = {"kv_connector": "KvopsLayerwiseConnector",
             "kv_connector_module_path": "torch_kvops.integrations.vllm"}
    prefill_cfg = dict(kvops, kv_role="kv_producer", kv_connector_extra_config={
        "side_channel_port": side_port, "wait_for_decode_s": 10.0, "step_timeout_s": 15.0,
        "connector": {"transfer_timeout_s": 5.0, "max_retries": 1, "quarantine_s": 0.2}})
    decode_cfg = dict(kvops, kv_role="kv_consumer", kv_load_failure_policy="recompute",
                      kv_connector_extra_config={"connector": {"lease_s": args.lease_s}})
    producer_addr = f"127.0.0.1:{side_port}"

    if args.threads:  # read by each engine's OpenMP runtime when it starts (spawn)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    pd_base = dict(base, disable_log_stats=False) if args.metrics else base
    engines = {"ref": Engine("reference", base),
               "P": Engine("prefill", dict(pd_base, kv_transfer_config=prefill_cfg)),
               "D": Engine("decode", dict(pd_base, kv_transfer_config=decode_cfg))}
    result: dict = {"load_average": list(os.getloadavg())}
    if link is not None:
        result["link"] = {"rate_gbit_s": link.rate_gbit_s, "delay_ms": link.delay_s * 1e3}
    try:
        t0 = time.monotonic()
        for eng in engines.values():
            eng.wait_ready(args.timeout)
        result["engines_ready_s"] = round(time.monotonic() - t0, 1)

        import random
        rng = random.Random(1234)
        prompts = [[rng.randrange(3, args.vocab) for _ in range(n)] for n in lens]
        ref_tokens: Dict[int, List[int]] = {}
        ttft: Dict[str, List[float]] = {m: [] for m in ["monolithic"] + [f"pd_{m}" for m in modes]}
        per_len: Dict[str, Dict[int, List[float]]] = {k: {} for k in ttft}
        matches, decode_prefill, chunks = [], [], []
        exposed: Dict[str, List[float]] = {m: [] for m in modes}
        last_layer: Dict[str, List[float]] = {m: [] for m in modes}
        p_first: Dict[str, List[float]] = {m: [] for m in modes}
        paired: Dict[tuple, Dict[str, float]] = {}
        records: List[dict] = []
        seq = 0

        def run_pd(i: int, mode: str, tag: str) -> dict:
            nonlocal seq
            seq += 1
            tid = f"{tag}-{seq}"
            sent = time.monotonic()
            engines["D"].submit([(tid, prompts[i], args.new_tokens, {
                "do_remote_prefill": True, "transfer_id": tid, "kvops_producer": producer_addr})])
            engines["P"].submit([(tid, prompts[i], 1, {
                "do_remote_decode": True, "transfer_id": tid, "kvops_push_mode": mode})])
            out = engines["D"].wait_done(tid, args.timeout)
            prefill = engines["P"].wait_done(tid, args.timeout)
            out["ttft"] = out["t_first"] - sent
            out["p_ttft"] = prefill["t_first"] - sent
            if os.environ.get("KVOPS_LOG_LEVEL") == "DEBUG":
                print(f"[proxy] {tid} sent {sent:.4f} P first {prefill['t_first']:.4f} "
                      f"D first {out['t_first']:.4f}", file=sys.stderr)
            steps = prefill["kvops_steps"]
            if not steps or steps[-1]["layers_pushed"] != args.layers:
                raise RuntimeError(f"{tid}: prefill side recorded no complete push step: {steps}")
            out["exposed"] = steps[-1]["exposed_after_forward_s"]
            out["last_layer"] = steps[-1]["last_layer_transfer_s"]
            out["p_chunks"] = len(steps)
            out["push_span"] = sum(s.get("push_span_s") or 0.0 for s in steps)
            # P's first push step began: it waited this long for D's block ids
            out["p_start"] = steps[0]["started_at"] - sent if "started_at" in steps[0] else None
            # P's forwards alone (bind -> wait_for_save), summed over its chunks
            out["p_forward"] = sum(s["forward_done_at"] - s["started_at"] for s in steps
                                   if "forward_done_at" in s)
            return out

        for rnd in range(args.warmup_rounds + args.rounds):
            timed = rnd >= args.warmup_rounds
            for i, n in enumerate(lens):
                seq += 1
                sent = time.monotonic()
                engines["ref"].submit([(f"ref-{seq}", prompts[i], args.new_tokens, None)])
                ref = engines["ref"].wait_done(f"ref-{seq}", args.timeout)
                ref_tokens[i] = ref["tokens"]
                if timed:
                    records.append({"len": n, "mode": "monolithic", "ttft": round(ref["t_first"] - sent, 5),
                                    "round": rnd, "load1": os.getloadavg()[0]})
                    ttft["monolithic"].append(ref["t_first"] - sent)
                    per_len["monolithic"].setdefault(n, []).append(ref["t_first"] - sent)
                # alternate the order of the modes so that drift in the machine's load
                # does not favour one of them
                for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                    out = run_pd(i, mode, mode)
                    if timed:
                        records.append({"len": n, "mode": mode, "ttft": round(out["ttft"], 5),
                                        "prefill_done": round(out["p_ttft"], 5),
                                        "exposed": round(out["exposed"], 5),
                                        "push_span": round(out["push_span"], 5),
                                        "p_start": out["p_start"] and round(out["p_start"], 5),
                                        "p_forward": round(out["p_forward"], 5),
                                        "round": rnd, "load1": os.getloadavg()[0]})
                        paired.setdefault((rnd, i), {})[mode] = out["ttft"]
                        exposed[mode].append(out["exposed"])
                        last_layer[mode].append(out["last_layer"])
                        ttft[f"pd_{mode}"].append(out["ttft"])
                        p_first[mode].append(out["p_ttft"])
                        per_len[f"pd_{mode}"].setdefault(n, []).append(out["ttft"])
                    matches.append(out["tokens"] == ref["tokens"])
                    if out["tokens"] != ref["tokens"]:
                        print(f"[mismatch] len {n} mode {mode}: {out['tokens']} != {ref['tokens']}",
                              file=sys.stderr)
                    if rnd == 0 and mode == modes[0]:
                        decode_prefill.append(local_prompt_tokens(out))
                        chunks.append(out["p_chunks"])

        result.update({
            "tokens_match": all(matches), "prompts": len(lens), "prompt_lens": lens,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "layers": args.layers, "hidden": args.hidden, "rounds": args.rounds,
            "kv_block_bytes": kv_block_bytes,
            "warmup_rounds": args.warmup_rounds,
            "ttft_s": {k: spread(v) for k, v in ttft.items() if v},
            "ttft_s_by_len": {k: {str(n): round(statistics.median(v), 4) for n, v in d.items()}
                              for k, d in per_len.items() if d},
            # the least-disturbed run of each: on a shared machine the median carries
            # other jobs' bursts
            "ttft_s_by_len_min": {k: {str(n): round(min(v), 4) for n, v in d.items()}
                                  for k, d in per_len.items() if d},
            "decode_prefill_tokens": sum(decode_prefill),
            "decode_prefill_tokens_per_prompt": decode_prefill,
            "prefill_push_steps_per_prompt": chunks,
            # engine time spent after P's last forward waiting for the push to land
            "exposed_after_forward_s": {m: spread(v) for m, v in exposed.items() if v},
            "last_layer_transfer_s": {m: spread(v) for m, v in last_layer.items() if v},
            # P's own first token (end of its prefill), from the proxy's send
            "prefill_done_s": {m: spread(v) for m, v in p_first.items() if v},
        })
        if args.records:
            result["records"] = records
        if len(modes) >= 2 and paired:
            diffs = [p[modes[0]] - p[modes[1]] for p in paired.values()]
            # the same prompt in the same round: most of the machine's noise cancels
            result[f"ttft_paired_{modes[0]}_minus_{modes[1]}_s"] = dict(
                spread(diffs), fraction_lower=round(sum(d < 0 for d in diffs) / len(diffs), 3))

        # P holds a request's blocks until its push is acknowledged, then frees them all
        result["prefill_blocks_after_drain"] = engines["P"].drain(30.0)
        if args.metrics:
            result["metrics"] = {"P": engines["P"].metrics()}

        if args.kill_prefill:
            i = max(range(len(lens)), key=lambda k: lens[k])
            typical = statistics.median(per_len[f"pd_{modes[0]}"][lens[i]])
            seq += 1
            tid = f"kill-{seq}"
            sent = time.monotonic()
            engines["D"].submit([(tid, prompts[i], args.new_tokens, {
                "do_remote_prefill": True, "transfer_id": tid, "kvops_producer": producer_addr})])
            engines["P"].submit([(tid, prompts[i], 1, {"do_remote_decode": True, "transfer_id": tid})])
            time.sleep(typical / 2)
            engines["P"].kill()
            killed = time.monotonic()
            out = engines["D"].wait_done(tid, args.timeout)
            result["kill"] = {
                "prompt_len": lens[i], "killed_after_s": round(killed - sent, 3),
                "p_exitcode": engines["P"].proc.exitcode,
                "d_finished_after_kill_s": round(out["t_done"] - killed, 3),
                "lease_s": args.lease_s, "d_finish_reason": out["finish_reason"],
                "d_tokens_match": out["tokens"] == ref_tokens[i],
                "d_local_prompt_tokens": local_prompt_tokens(out),
            }
        if args.metrics:  # after the kill: D counts the failure it saw
            result["metrics"]["D"] = engines["D"].metrics()
    finally:
        problems = []
        for name, eng in engines.items():
            try:
                eng.stop()
            except (RuntimeError, OSError) as exc:
                problems.append(f"{name}: {exc}")
        tmp.cleanup()
        if problems:
            print("[stop] " + "; ".join(problems), file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
