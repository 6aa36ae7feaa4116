"""TTFT of SGLang prefill/decode disaggregation over an emulated link: this package's
layer-wise ``kvops`` backend against SGLang's own ``mooncake`` backend (which sends a
chunk's KV after its forward) and a monolithic SGLang server, in the same run (issue 35).

    python -m torch_kvops.bench.sglang_ttft [--link 1gbit] [--prompt-lens 1000,2000,3000]

The run re-runs itself inside a network namespace whose loopback is shaped to ``--link``
(torch_kvops/emulated_link.py; needs root), so P's KV crosses the shaped link. Three
setups, each ``python -m sglang.launch_server`` on CPU (SGLang 0.5.23 from
``make setup-sglang``): ``mono`` (one server), ``kvops`` and ``mooncake`` (P, D and
sglang-router in P/D mode); with ``--setups mono,kvops,kvops-head,mooncake`` also
``kvops-head``, the ``kvops`` backend moving MHA KV by head (``"mha_unit": "head"``), to
price that against whole pages. With ``--sliding-window W`` the model is the test Mellum
(layers alternating a W-token sliding window and full attention; every server with
``--disable-hybrid-swa-memory``), and ``kvops-all`` is the ``kvops`` backend pushing a
sliding layer's every page (``"sliding_layers": "all"``) against its window only
(``kvops``). With ``--hybrid-pool`` too, every server keeps SGLang's hybrid pool (the
sliding layers' windows in a pool of their own, SGLang's default for such models) and
loads the test-only stand-in ``cpu_swa_reads`` (below). An idle SGLang scheduler polls
its sockets without sleeping (a core each), so one setup runs at a time; the setups
alternate in order over ``--cycles`` starts each. Every request is a prompt of its own
(no prefix cache hit), streamed; TTFT = the client's send -> the first token's chunk. Every answer is checked
against the monolithic server's (greedy), and D's own prefill counter must stay at 0.

*bound* = max(prefill, prefill / layers + wire) per prompt length, with prefill = the
monolithic TTFT and wire = the prompt's KV bytes at the link's rate (of a sliding layer,
its window's: what D reads): the TTFT a push that hides all but the last layer's
transfer reaches.

SGLang's CPU engine needs two kernels of sgl_kernel that have no wheel on PyPI: the
test-only stand-in (tests/sglang_standin, ``--standin``) is put on the servers' path.
With ``--hybrid-pool``, its ``cpu_swa_reads`` is loaded as a plugin by every server alike
(the monolithic one too): SGLang 0.5.23's CPU attention reads a hybrid pool's sliding
layer at the wrong slots, and answers unlike ``transformers``' would fail every check.
SGLang's mooncake backend records a ``torch.cuda.Event`` on P unless its sender's
``supports_host_tensor_indices`` is off: a plugin written into the run's directory turns
it off in that P (the CPU workaround of ../shared/FIELD-NOTES.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

from ..serving import prometheus
from ..serving.fronts import write_entry_point
from ..serving.model import random_prompt, write_serving_model
from ..serving.servers import Servers
from ..serving.sglang import REPO, SglangRouterSpec, SglangServerSpec
from .serving_sweep import kv_bytes_per_token

SETUPS = ("mono", "kvops", "mooncake")  # the default run
# kvops-head: the kvops backend moving MHA KV by head ("mha_unit": "head"), to price it
# against whole pages in the same run
KNOWN_SETUPS = ("mono", "kvops", "kvops-head", "kvops-all", "mooncake")
LAYERWISE = ("kvops", "kvops-head", "kvops-all")
LABEL = {"mono": "TTFT monolithic s", "mooncake": "P/D mooncake s", "kvops": "P/D kvops layer-wise s",
         "kvops-head": "P/D kvops by head s", "kvops-all": "P/D kvops every sliding page s"}
ONE_POOL = ["--disable-hybrid-swa-memory"]  # a sliding-window model in SGLang's one KV pool
CPU_MOONCAKE_PLUGIN = '''def install():
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    MooncakeKVSender.supports_host_tensor_indices = False  # else a torch.cuda.Event on P
'''


def parse_args(argv: Optional[List[str]]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="1gbit", help="emulated link RATE[,DELAY] (needs root)")
    ap.add_argument("--prompt-lens", default="1000,2000,3000")
    ap.add_argument("--rounds", type=int, default=3, help="timed prompts per length per start")
    ap.add_argument("--cycles", type=int, default=2, help="starts of each setup, orders alternating")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--sliding-window", type=int, default=0,
                    help="tokens; > 0: the test Mellum, even layers sliding (setup kvops-all too)")
    ap.add_argument("--hybrid-pool", action="store_true",
                    help="with --sliding-window: SGLang's hybrid pool (not --disable-hybrid-swa-memory)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per server")
    ap.add_argument("--standin", default=os.path.join(REPO, "tests", "sglang_standin"),
                    help="directory of the test-only sgl_kernel stand-in")
    ap.add_argument("--setups", default=",".join(SETUPS),
                    help=f"comma-separated, of {','.join(KNOWN_SETUPS)} (mono and mooncake needed)")
    ap.add_argument("--out", default="sglang-ttft.json")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--link-timeout", type=float, default=3 * 3600.0)
    args = ap.parse_args(argv)
    named = args.setups.split(",")
    args.setups = tuple(s for s in KNOWN_SETUPS if s in named)
    if set(named) - set(KNOWN_SETUPS) or "mono" not in args.setups or "mooncake" not in args.setups:
        ap.error(f"--setups: of {KNOWN_SETUPS}, with mono and mooncake")
    if "kvops-all" in args.setups and args.sliding_window <= 0:
        ap.error("--setups kvops-all: with --sliding-window")
    if args.hybrid_pool and (args.sliding_window <= 0 or {"kvops-all", "kvops-head"} & set(args.setups)):
        # a hybrid pool holds a sliding layer's window only; by head it is refused (docs/sglang.md)
        ap.error("--hybrid-pool: with --sliding-window, without kvops-all and kvops-head")
    return args


def stream_ttft(url: str, model: str, prompt: str, new_tokens: int, timeout: float = 300.0):
    """(TTFT s, the answer's text) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, first, text = time.monotonic(), None, []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"streamed error: {event['error']}")
            piece = event["choices"][0].get("text") or ""
            if piece and first is None:
                first = time.monotonic() - start
            text.append(piece)
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first, "".join(text)


def add_setups(servers: Servers, model: str, args, plugin_dir: str, standin_dir: str) -> Dict[str, List]:
    path = [standin_dir, args.standin] if args.hybrid_pool else [args.standin]
    env = {"PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": str(args.threads)}
    cpu_mooncake = dict(env, PYTHONPATH=os.pathsep.join([plugin_dir, *path]))
    one_pool = args.sliding_window > 0 and not args.hybrid_pool
    same = dict(page_size=16, max_total_tokens=8192, extra_args=ONE_POOL if one_pool else [])
    by_head = dict(env, KVOPS_SGLANG_CONFIG=json.dumps({"mha_unit": "head"}))
    every_page = dict(env, KVOPS_SGLANG_CONFIG=json.dumps({"sliding_layers": "all"}))
    envs = {"kvops": env, "kvops-head": by_head, "kvops-all": every_page, "mooncake": cpu_mooncake}
    fleets = {"mono": [servers.add(SglangServerSpec("mono", model, env=env, **same))]}
    for setup in args.setups[1:]:
        backend = "mooncake" if setup == "mooncake" else "kvops"
        p = servers.add(SglangServerSpec(f"{setup}-P", model, role="prefill", transfer_backend=backend,
                                         env=envs[setup], **same))
        d = servers.add(SglangServerSpec(f"{setup}-D", model, role="decode", transfer_backend=backend,
                                         env=envs[setup], **same))
        router = servers.add(SglangRouterSpec(f"{setup}-router", [p], [d]))
        fleets[setup] = [p, d, router]
    return fleets


def write_plugins(plugin_dir: str, standin_dir: str) -> None:
    """As SGLang plugins: the CPU workaround for SGLang's mooncake backend, and the
    test-only stand-in's hybrid-pool reads (put on the path with ``--hybrid-pool`` only)."""
    os.makedirs(plugin_dir)
    with open(os.path.join(plugin_dir, "kvops_bench_cpu_mooncake.py"), "w") as f:
        f.write(CPU_MOONCAKE_PLUGIN)
    write_entry_point(plugin_dir, "kvops-bench-cpu-mooncake", "sglang.srt.plugins",
                      "kvops_bench_cpu_mooncake:install")
    os.makedirs(standin_dir)
    write_entry_point(standin_dir, "kvops-test-cpu_swa_reads", "sglang.srt.plugins", "cpu_swa_reads:install")


def _wait_for_workers(url: str, model: str, timeout: float = 120.0) -> None:
    """sglang-router answers 503 until its first health check of P and D passed."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stream_ttft(url, model, "w10 w11 w12", 1)
            return
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def run_setup(name: str, fleet: List, servers: Servers, model: str, prompts: Dict[int, List[str]],
              args, cycle: int) -> List[dict]:
    """Start one setup, warm it up, time its prompts, read its counters, stop it."""
    engines = [s.name for s in fleet if s.spec.role != "proxy"]
    servers.start(engines, args.start_timeout)
    servers.start([s.name for s in fleet if s.spec.role == "proxy"], args.start_timeout)
    front = fleet[-1]
    if name != "mono":
        _wait_for_workers(front.url, model)
    rng = random.Random(f"warm-up {cycle}")
    for n in prompts:  # first requests pay one-off costs
        stream_ttft(front.url, model, random_prompt(n, args.vocab, rng), args.new_tokens)
    records = []
    for n, texts in prompts.items():
        for i, prompt in enumerate(texts):
            ttft, answer = stream_ttft(front.url, model, prompt, args.new_tokens)
            records.append({"setup": name, "cycle": cycle, "tokens": n, "prompt": i,
                            "ttft_s": ttft, "answer": answer})
            print(f"[sglang-ttft] {name} cycle {cycle}: {n} tokens, TTFT {ttft:.3f} s",
                  file=sys.stderr, flush=True)
    if name != "mono":
        p, d = (prometheus.fetch(s.url) for s in fleet[:2])
        counters = {"decode_prefill_tokens": prometheus.total(
            d, "sglang:prefill_effective_tokens_total", mode="input")}
        if name in LAYERWISE:
            counters.update({k: prometheus.total(p, f"kvops_sglang_{k}_total")
                             for k in ("layers", "layers_landed_during_forward", "pushed_bytes",
                                     "window_pages_skipped")})
        records.append({"setup": name, "cycle": cycle, "counters": counters})
    for server in fleet[::-1]:
        server.stop()
    return records


def summarize(saved: dict) -> List[dict]:
    timed = [r for r in saved["records"] if "ttft_s" in r]
    setups = [s for s in KNOWN_SETUPS if any(r["setup"] == s for r in timed)]
    rows = []
    for n in sorted({r["tokens"] for r in timed}):
        ttft = {s: sorted(r["ttft_s"] for r in timed if r["setup"] == s and r["tokens"] == n)
                for s in setups}
        med = {s: statistics.median(v) for s, v in ttft.items()}
        kv_bytes = read_kv_bytes(saved["model"], n)
        wire = kv_bytes * 8 / saved["link_bit_s"]
        bound = max(med["mono"], med["mono"] / saved["model"]["num_hidden_layers"] + wire)
        row = {"tokens": n, "kv_mib": kv_bytes / 2**20,
               "wire_s": wire, "bound_s": bound,
               **{f"{s}_s": med[s] for s in setups},
               **{f"{s}_range": [v[0], v[-1]] for s, v in ttft.items()}}
        for s in (s for s in LAYERWISE if s in setups):
            row.update({f"{s}_over_bound": med[s] / bound, f"{s}_below_mooncake": 1 - med[s] / med["mooncake"],
                        f"{s}_hidden_s": med["mooncake"] - med[s]})
        rows.append(row)
    return rows


def read_kv_bytes(model: dict, tokens: int) -> int:
    """The KV bytes of a prompt that D reads: every token of a full layer, the last
    ``sliding_window`` of a sliding one (the test Mellum: even layers slide)."""
    window = model.get("sliding_window") if model.get("model_type") == "mellum" else None
    if not window:
        return tokens * model["kv_bytes_per_token"]
    layers = model["num_hidden_layers"]
    sliding = (layers + 1) // 2
    return model["kv_bytes_per_token"] * ((layers - sliding) * tokens + sliding * min(tokens, window)) // layers


def render(rows: List[dict]) -> str:
    """One table row per prompt length: medians [min, max] of each setup, then per
    layer-wise setup its ratio to the bound and to mooncake."""
    timed = [s for s in ("mono", "mooncake", *LAYERWISE) if f"{s}_s" in rows[0]]
    ours = [s for s in LAYERWISE if s in timed]
    head = (["prompt tokens", "KV MiB", "wire s"] + [LABEL[s] for s in timed] + ["bound s"]
            + [c for s in ours for c in (f"{s} / bound", f"{s} below mooncake", f"mooncake - {s} s")])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [f"{r['tokens']}", f"{r['kv_mib']:.0f}", f"{r['wire_s']:.2f}"]
        cells += [f"{r[f'{s}_s']:.2f} [{r[f'{s}_range'][0]:.2f}, {r[f'{s}_range'][1]:.2f}]" for s in timed]
        cells.append(f"{r['bound_s']:.2f}")
        for s in ours:
            cells += [f"{r[f'{s}_over_bound']:.2f}", f"{100 * r[f'{s}_below_mooncake']:.0f}%",
                      f"{r[f'{s}_hidden_s']:+.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _key(record: dict) -> tuple:
    return record["cycle"], record["tokens"], record["prompt"]


def check(saved: dict) -> List[str]:
    """What makes the run invalid: an answer unlike the monolithic server's, a D that
    computed prompt tokens, a kvops P whose layers never landed during its forward."""
    timed = [r for r in saved["records"] if "ttft_s" in r]
    reference = {_key(r): r["answer"] for r in timed if r["setup"] == "mono"}
    problems = [f"{r['setup']} cycle {r['cycle']}: {r['tokens']} tokens #{r['prompt']} answered "
                f"{r['answer']!r}, the monolithic server {reference[_key(r)]!r}"
                for r in timed if r["answer"] != reference[_key(r)]]
    for r in (r for r in saved["records"] if "counters" in r):
        if r["counters"]["decode_prefill_tokens"]:
            problems.append(f"{r['setup']} cycle {r['cycle']}: D computed prompt tokens: {r['counters']}")
        if r["setup"] in LAYERWISE and not r["counters"]["layers_landed_during_forward"]:
            problems.append(f"{r['setup']} cycle {r['cycle']}: no layer landed during P's forward")
    return problems


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from ..emulated_link import enter_link
    link = enter_link(args.link, [sys.executable, "-m", "torch_kvops.bench.sglang_ttft", *argv],
                      args.link_timeout)
    lengths = [int(n) for n in args.prompt_lens.split(",") if n]
    logs = tempfile.mkdtemp(prefix="kvops-sglang-ttft-logs-")
    saved: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args),
                   "link": link.text, "link_bit_s": link.rate_bit_s, "logs": logs, "records": []}
    with tempfile.TemporaryDirectory(prefix="kvops-sglang-ttft-") as tmp:
        model, plugin, standin = (os.path.join(tmp, name) for name in ("model", "plugin", "standin"))
        window = dict(swa=True, window=args.sliding_window) if args.sliding_window > 0 else {}
        config = write_serving_model(model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                                     kv_heads=args.kv_heads, vocab=args.vocab,
                                     max_len=max(lengths) + args.new_tokens + 64, **window)
        saved["model"] = dict(config, kv_bytes_per_token=kv_bytes_per_token(config))
        write_plugins(plugin, standin)
        print(f"[sglang-ttft] {kv_bytes_per_token(config) // 1024} KiB of KV per token, link "
              f"{link.text}; logs in {logs}", file=sys.stderr, flush=True)
        with Servers(logs) as servers:
            fleets = add_setups(servers, model, args, plugin, standin)
            for cycle in range(args.cycles):
                rng = random.Random(cycle)  # the same prompts for every setup of a cycle
                prompts = {n: [random_prompt(n, args.vocab, rng) for _ in range(args.rounds)]
                           for n in lengths}
                order = args.setups if cycle % 2 == 0 else args.setups[::-1]
                for name in order:
                    saved["records"] += run_setup(name, fleets[name], servers, model, prompts, args, cycle)
                    with open(args.out, "w") as f:
                        json.dump(saved, f, indent=1)
    saved["rows"] = summarize(saved)
    saved["problems"] = check(saved)
    with open(args.out, "w") as f:
        json.dump(saved, f, indent=1)
    print(render(saved["rows"]))
    for problem in saved["problems"]:
        print(f"PROBLEM: {problem}")
    return 1 if saved["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
