"""Serving benchmark: a request-rate sweep of `vllm serve` fleets under vLLM's own load
client (`vllm bench serve`), inside an emulated 1 Gbit/s link (issue 23, item 6; the
TTFT per dispatch order of issue 22).

    python -m torch_kvops.bench.serving_sweep [--quick] [--link 1gbit] [--out DIR]

The whole run re-runs itself inside a network namespace whose loopback is shaped to
``--link`` (torch_kvops/emulated_link.py; needs root, and fails without it), so every
server, router, proxy and client talks over the shaped link. One fleet, started once:

- ``mono-rr``: 2 monolithic replicas behind vllm-router, round robin;
- ``pd-concurrent``: 1P1D layer-wise, our proxy sending P and D at once;
- ``pd-dfirst``: the same P and D, our proxy sending D first;
- ``pd-router``: the same P and D behind vllm-router in P/D mode (mooncake: P first;
  P holds the blocks until D's destination comes, then pushes them all);
- ``pd-after-forward``: a second P with ``push_mode: after_forward``, the same D, our
  proxy concurrent.

Every server runs one torch thread. For each rate every configuration is loaded in turn
(the order alternates between rates so the machine's drift favours none) with the same
prompts and Poisson arrival times (same seed). Per point: TTFT and TPOT p50/p99, goodput,
throughput, completed/failed, and for P/D whether D's KV came from P (D's
``vllm:prompt_tokens_by_source_total{source="local_compute"}`` may grow by at most one
token per request). Output (``--out``): serving-sweep.json (every record),
serving-sweep.md (the table and the ratios), serving_sweep.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..serving import prometheus
from ..serving.load import LoadError, random_load_args, run_load
from ..serving.model import random_prompt, write_serving_model
from ..serving.servers import ProxySpec, ReplicaRouterSpec, RouterSpec, Server, Servers, ServerSpec
from . import serving_report

PROMPT_METRIC = "vllm:prompt_tokens_by_source_total"


@dataclass
class Config:
    """One way of serving: the front end the client talks to and, for P/D, the D whose
    prompt-token sources tell whether the KV came from P."""

    key: str
    label: str
    front: Server
    decode: Optional[Server] = None


def kv_bytes_per_token(config: dict) -> int:
    """K and V of every layer for one token (float32)."""
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4


def start_fleet(servers: Servers, model: str, args) -> List[Config]:
    """Add and start every server and front end; the configurations in sweep order."""
    common = dict(threads=1, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=args.max_num_seqs, lease_s=args.lease_s)
    monos = [servers.add(ServerSpec(f"mono{i}", model, role="monolithic", **common)) for i in (1, 2)]
    p = servers.add(ServerSpec("P", model, role="prefill", **common))
    p_af = servers.add(ServerSpec("P-after-forward", model, role="prefill",
                                  kv_connector_extra_config={"push_mode": "after_forward"}, **common))
    d = servers.add(ServerSpec("D", model, role="decode", **common))
    # negative control of the KV check: D gets no transfer parameters and prefills itself
    proxy_args = ["--no-decode-params"] if args.control_no_kv else []
    configs = [
        Config("mono-rr", "2x monolithic, round robin (vllm-router)",
               servers.add(ReplicaRouterSpec("rr", monos))),
        Config("pd-concurrent", "1P1D layer-wise, concurrent (our proxy)",
               servers.add(ProxySpec("proxy-concurrent", [p], [d], order="concurrent",
                                 extra_args=proxy_args)), d),
        Config("pd-dfirst", "1P1D layer-wise, D first (our proxy)",
               servers.add(ProxySpec("proxy-dfirst", [p], [d], order="d-first",
                                 extra_args=proxy_args)), d),
        Config("pd-router", "1P1D P first (vllm-router, mooncake)",
               servers.add(RouterSpec("router-pd", [p], [d])), d),
        Config("pd-after-forward", "1P1D push after forward, concurrent (our proxy)",
               servers.add(ProxySpec("proxy-after-forward", [p_af], [d], order="concurrent",
                                 extra_args=proxy_args)), d),
    ]
    servers.start_all(args.start_timeout)
    return configs


def warm_up(cfg: Config, model: str, vocab: int, n: int, prompt_len: int, timeout: float) -> None:
    """A few requests through the front end, not measured: the first requests after
    start-up pay one-off costs (connections, the engines' first steps)."""
    rng = random.Random(99)
    for _ in range(n):
        body = json.dumps({"model": model, "prompt": random_prompt(prompt_len, vocab, rng),
                           "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{cfg.front.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{cfg.key}: warm-up request answered {resp.status}")
            resp.read()


def prompt_sources(d: Server) -> Dict[str, float]:
    samples = d.metrics()
    return {s: prometheus.total(samples, PROMPT_METRIC, source=s)
            for s in ("local_compute", "external_kv_transfer")}


def measure(cfg: Config, rate: float, num_prompts: int, model: str, args, log_path: str) -> dict:
    """One point: the load client against ``cfg``'s front end at ``rate``."""
    load = random_load_args(model=model, num_prompts=num_prompts, input_len=args.input_len,
                            range_ratio=args.range_ratio, output_len=args.output_len,
                            max_concurrency=args.max_concurrency, request_rate=rate, seed=args.seed,
                            goodput=[f"ttft:{args.goodput_ttft_ms:g}", f"tpot:{args.goodput_tpot_ms:g}"])
    before = prompt_sources(cfg.decode) if cfg.decode else None
    t0 = time.monotonic()
    try:
        res = run_load(cfg.front.url, load, timeout_s=args.point_timeout, log_path=log_path)
    except LoadError as exc:
        print(f"[sweep] FAILED {cfg.key} at {rate:g} req/s: {exc}", file=sys.stderr, flush=True)
        return {"config": cfg.key, "label": cfg.label, "rate": rate, "num_prompts": num_prompts,
                "error": str(exc)}
    rec = {"config": cfg.key, "label": cfg.label, "rate": rate, "num_prompts": num_prompts,
           "wall_s": round(time.monotonic() - t0, 2), "load1": os.getloadavg()[0]}
    for key in ("completed", "failed", "duration", "request_throughput", "request_goodput",
                "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
                "ttfts", "latencies", "input_lens", "output_lens"):
        rec[key] = res.get(key)
    rec["errors"] = [e for e in res.get("errors", []) if e]
    if before is not None:
        after = prompt_sources(cfg.decode)
        local = after["local_compute"] - before["local_compute"]
        rec["decode_local_prompt_tokens"] = local
        rec["decode_external_prompt_tokens"] = after["external_kv_transfer"] - before["external_kv_transfer"]
        # D recomputes at most the last prompt token of a request whose KV came from P
        rec["kv_from_prefill"] = local <= num_prompts and (
            rec["decode_external_prompt_tokens"] + local >= sum(rec["input_lens"] or [0]) - num_prompts)
        if not rec["kv_from_prefill"]:
            print(f"[sweep] WARNING {cfg.key} at {rate:g} req/s: D computed {local:.0f} prompt "
                  f"tokens for {num_prompts} requests ({rec['decode_external_prompt_tokens']:.0f} "
                  f"came from P): the KV did not all come from P",
                  file=sys.stderr, flush=True)
    print(f"[sweep] {cfg.key:17s} {rate:5g} req/s: {rec['completed']}/{num_prompts} done, "
          f"TTFT p50 {rec['median_ttft_ms']:.0f} ms, TPOT p50 {rec['median_tpot_ms']:.1f} ms, "
          f"{rec['wall_s']:.0f} s wall, load {rec['load1']:.1f}", file=sys.stderr, flush=True)
    return rec


def prompts_for(rate: float, args) -> int:
    """Requests per point: about ``--seconds-per-point`` of arrivals, within bounds."""
    if rate == float("inf"):
        return args.max_prompts
    return max(args.min_prompts, min(args.max_prompts, round(rate * args.seconds_per_point)))


def parse_args(argv: Optional[List[str]]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: one rate, 4 requests of ~512 tokens per configuration")
    ap.add_argument("--link", default="1gbit",
                    help="emulated link RATE[,DELAY] (needs root); 'none': plain loopback")
    ap.add_argument("--out", default="serving-sweep", help="directory for the JSON, table and plot")
    ap.add_argument("--rates", default="0.5,1,2,4", help="request rates, req/s (inf: all at once)")
    ap.add_argument("--seconds-per-point", type=float, default=12.0)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--max-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="prompt lengths input-len*(1 +- r)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=32)
    ap.add_argument("--goodput-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--goodput-tpot-ms", type=float, default=100.0)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests per configuration")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--lease-s", type=float, default=60.0, help="D's lease on a transfer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--control-no-kv", action="store_true",
                    help="negative control: our proxies send D no transfer parameters, so D "
                         "computes the prompts and the KV check must warn (the run exits 1)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--point-timeout", type=float, default=300.0)
    ap.add_argument("--link-timeout", type=float, default=3600.0, help="bound of the whole run, s")
    args = ap.parse_args(argv)
    if args.quick:
        args.rates, args.min_prompts, args.max_prompts, args.warmup = "2", 4, 4, 1
        args.input_len = 512
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    link = None
    if args.link != "none":
        from ..emulated_link import enter_link
        # outside: re-run this command inside a new namespace and leave with its status
        link = enter_link(args.link, [sys.executable, "-m", "torch_kvops.bench.serving_sweep", *argv],
                          args.link_timeout)
    t_start = time.monotonic()
    rates = [float(r) for r in args.rates.split(",") if r]
    os.makedirs(args.out, exist_ok=True)
    logs = tempfile.mkdtemp(prefix="kvops-serving-sweep-logs-")
    saved: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args),
                   "link": link.text if link else "none (plain loopback)", "logs": logs, "records": []}
    with tempfile.TemporaryDirectory(prefix="kvops-serving-sweep-model-") as model:
        config = write_serving_model(model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                                     kv_heads=args.kv_heads, vocab=args.vocab,
                                     max_len=max(4096, int(args.input_len * (1 + args.range_ratio))
                                                 + args.output_len + 64))
        saved["model"] = dict(config, kv_bytes_per_token=kv_bytes_per_token(config))
        kv_mib = kv_bytes_per_token(config) * args.input_len / 2**20
        wire = f", {kv_mib * 8 * 2**20 / link.rate_bit_s:.2f} s on the link" if link else ""
        print(f"[sweep] model: {args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV heads: "
              f"{kv_bytes_per_token(config) // 1024} KiB of KV per token, {kv_mib:.0f} MiB for "
              f"{args.input_len} tokens{wire}; logs in {logs}", file=sys.stderr, flush=True)
        with Servers(logs) as servers:
            configs = start_fleet(servers, model, args)
            saved["fleet_ready_s"] = round(time.monotonic() - t_start, 1)
            print(f"[sweep] fleet ready in {saved['fleet_ready_s']} s", file=sys.stderr, flush=True)
            for cfg in configs:
                warm_up(cfg, model, args.vocab, args.warmup, args.input_len, args.point_timeout)
            for i, rate in enumerate(rates):
                for cfg in (configs if i % 2 == 0 else configs[::-1]):
                    saved["records"].append(measure(cfg, rate, prompts_for(rate, args), model, args,
                                                    os.path.join(logs, f"load-{cfg.key}.log")))
                    with open(os.path.join(args.out, "serving-sweep.json"), "w") as f:
                        json.dump(saved, f, indent=1)  # after every point: a failure keeps these
            problems = servers.stop_all()
            if problems:
                print(f"[sweep] stopping the fleet: {problems}", file=sys.stderr)
    saved["total_s"] = round(time.monotonic() - t_start, 1)
    with open(os.path.join(args.out, "serving-sweep.json"), "w") as f:
        json.dump(saved, f, indent=1)
    report = serving_report.render(saved)
    with open(os.path.join(args.out, "serving-sweep.md"), "w") as f:
        f.write(report + "\n")
    print(report)
    print(f"plot: {serving_report.plot(saved, os.path.join(args.out, 'serving_sweep.png'))}")
    print(f"total time: {saved['total_s']:.0f} s (fleet ready after {saved['fleet_ready_s']:.0f} s)")
    failed = [r for r in saved["records"] if r.get("error") or r.get("failed")
              or r.get("kv_from_prefill") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
