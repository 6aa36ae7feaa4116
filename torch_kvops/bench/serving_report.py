"""Table, ratios and plot of a serving sweep (torch_kvops/bench/serving_sweep.py).

    python -m torch_kvops.bench.serving_report DIR/serving-sweep.json [--plot PNG]

redraws them from a saved run without running anything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional, Tuple

ORDER = ["mono-rr", "pd-concurrent", "pd-dfirst", "pd-router", "pd-after-forward"]
# (numerator, denominator, goal): issue 22's TTFT ratios
RATIOS = [("pd-concurrent", "pd-dfirst", 1.05), ("pd-router", "pd-after-forward", 1.10)]


def _points(saved: dict) -> Dict[Tuple[str, float], dict]:
    return {(r["config"], r["rate"]): r for r in saved["records"] if not r.get("error")}


def _rates(saved: dict) -> List[float]:
    return sorted({r["rate"] for r in saved["records"]})


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.0f}"


def table(saved: dict) -> str:
    """One row per configuration and rate."""
    lines = ["| config | rate req/s | done / failed | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
             "| TPOT p99 ms | goodput req/s | throughput req/s | D computed (tokens / requests) | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by_key = {(r["config"], r["rate"]): r for r in saved["records"]}
    for rate in _rates(saved):
        for key in ORDER:
            r = by_key.get((key, rate))
            if r is None:
                continue
            if r.get("error"):
                lines.append(f"| {key} | {rate:g} | client failed: {r['error'][:60]} |" + " |" * 8)
                continue
            local = r.get("decode_local_prompt_tokens")
            src = "-" if local is None else f"{local:.0f} / {r['num_prompts']}" + (
                "" if r["kv_from_prefill"] else " **not from P**")
            goodput = r.get("request_goodput")
            lines.append(
                f"| {key} | {rate:g} | {r['completed']} / {r['failed']} | {_ms(r['median_ttft_ms'])} "
                f"| {_ms(r['p99_ttft_ms'])} | {r['median_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} "
                f"| {'-' if goodput is None else f'{goodput:.2f}'} | {r['request_throughput']:.2f} "
                f"| {src} | {r['load1']:.1f} |")
    return "\n".join(lines)


def ratios(saved: dict) -> List[str]:
    """Issue 22's TTFT ratios per rate (p50 and p99) and their median over the rates."""
    pts, out = _points(saved), []
    for num, den, goal in RATIOS:
        per_rate, cells = [], []
        for rate in _rates(saved):
            a, b = pts.get((num, rate)), pts.get((den, rate))
            if not a or not b or not b["median_ttft_ms"] or not b["p99_ttft_ms"]:
                continue
            r50, r99 = a["median_ttft_ms"] / b["median_ttft_ms"], a["p99_ttft_ms"] / b["p99_ttft_ms"]
            per_rate.append(r50)
            cells.append(f"{rate:g} req/s: {r50:.2f} (p99 {r99:.2f})")
        if per_rate:
            med = statistics.median(per_rate)
            verdict = "met" if med <= goal else "NOT met"
            out.append(f"- TTFT p50 {num} / {den}: median over rates {med:.2f} "
                       f"(goal <= {goal:.2f}: {verdict}); " + "; ".join(cells))
    return out


def _cmp(pd: float, mono: float, lower_is_better: bool = True) -> str:
    if not mono:
        return "n/a"
    change = pd / mono - 1
    better = change < 0 if lower_is_better else change > 0
    return f"{'P/D better' if better else 'P/D worse'} by {abs(change) * 100:.0f}%"


def versus_replicas(saved: dict) -> List[str]:
    """Where 1P1D layer-wise (the better of concurrent and D first by TTFT p50) wins or
    loses against 2 monolithic replicas, per rate."""
    pts, out = _points(saved), []
    for rate in _rates(saved):
        mono = pts.get(("mono-rr", rate))
        pds = [pts[(k, rate)] for k in ("pd-concurrent", "pd-dfirst") if (k, rate) in pts]
        if not mono or not pds:
            continue
        pd = min(pds, key=lambda r: r["median_ttft_ms"])
        gp_pd, gp_mono = pd.get("request_goodput") or 0.0, mono.get("request_goodput") or 0.0
        out.append(
            f"- {rate:g} req/s, {pd['config']} vs mono-rr: TTFT p50 {pd['median_ttft_ms']:.0f} vs "
            f"{mono['median_ttft_ms']:.0f} ms ({_cmp(pd['median_ttft_ms'], mono['median_ttft_ms'])}); "
            f"TPOT p50 {pd['median_tpot_ms']:.1f} vs {mono['median_tpot_ms']:.1f} ms "
            f"({_cmp(pd['median_tpot_ms'], mono['median_tpot_ms'])}); goodput {gp_pd:.2f} vs "
            f"{gp_mono:.2f} req/s ({_cmp(gp_pd, gp_mono, lower_is_better=False)})")
    return out


def render(saved: dict) -> str:
    """The markdown report: conditions, table, ratios, P/D against replicas, warnings."""
    a, m = saved["args"], saved["model"]
    head = (f"Serving sweep {saved['started']}: link {saved['link']}; model {m['num_hidden_layers']} "
            f"layers, hidden {m['hidden_size']}, {m['num_key_value_heads']} KV heads, float32 "
            f"({m['kv_bytes_per_token'] // 1024} KiB KV/token); prompts {a['input_len']} tokens "
            f"+-{a['range_ratio'] * 100:.0f}%, {a['output_len']} output tokens, Poisson arrivals "
            f"(seed {a['seed']}), max concurrency {a['max_concurrency']}; goodput: TTFT <= "
            f"{a['goodput_ttft_ms']:g} ms and TPOT <= {a['goodput_tpot_ms']:g} ms; one torch thread "
            f"per server; total {saved.get('total_s', '?')} s")
    parts = [head, "", table(saved), "", "Ratios (issue 22):", *ratios(saved), "",
             "1P1D layer-wise against 2 monolithic replicas:", *versus_replicas(saved)]
    bad = [r for r in saved["records"] if r.get("error") or r.get("failed")
           or r.get("kv_from_prefill") is False]
    if bad:
        parts += ["", "Warnings:"] + [
            f"- {r['config']} at {r['rate']:g} req/s: " + (
                r.get("error") or (f"{r['failed']} failed: {r['errors'][:2]}" if r.get("failed")
                                   else f"D computed {r['decode_local_prompt_tokens']:.0f} prompt tokens"))
            for r in bad]
    return "\n".join(parts)


def plot(saved: dict, path: str) -> str:
    """TTFT and TPOT (p50 solid, p99 dashed) against the request rate, per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts, rates = _points(saved), _rates(saved)
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for i, key in enumerate(ORDER):
        rs = [r for r in rates if (key, r) in pts]
        if not rs:
            continue
        color = f"C{i}"
        for ax, metric in ((axes[0], "ttft"), (axes[1], "tpot")):
            ax.plot(rs, [pts[(key, r)][f"median_{metric}_ms"] for r in rs], "o-", color=color,
                    label=f"{key} p50")
            ax.plot(rs, [pts[(key, r)][f"p99_{metric}_ms"] for r in rs], "x--", color=color,
                    alpha=0.6, label=f"{key} p99")
    for ax, name in ((axes[0], "time to first token, ms"), (axes[1], "time per output token, ms")):
        ax.set_xlabel("request rate, req/s")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.suptitle(f"vllm serve fleets under vllm bench serve, link {saved['link']}; 2-core CPU",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        saved = json.load(f)
    print(render(saved))
    print(f"plot: {plot(saved, args.plot or os.path.join(os.path.dirname(args.json), 'serving_sweep.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
