"""Where 1P1D serving loses time on a small CPU host (issue 23, "find the stalls"):
one monolithic server against 1P1D (our proxy, concurrent dispatch) at concurrency 4
and 8 on loopback, with vLLM's message-queue busy-spin as shipped (1 s after every
step) and shortened (``--short-spin-s``, default 2 ms; serving/shm_spin/).

    python -m torch_kvops.bench.serving_stalls [--reps 3] [--requests 16] [--out FILE]

Two fleets (mono + P + D + proxy each), started once; every repetition loads every
(fleet, server, concurrency) in turn with the same prompts (vLLM's random dataset,
200-1100 tokens, 6 output tokens: the issue's figure) through ``vllm bench serve``.
Prints wall time and TTFT p50/max per point, and the medians' ratios P/D : mono per
fleet. Each P/D point checks that D's KV came from P (D computed at most one prompt
token per request).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from typing import Dict, List, Tuple

from ..serving import prometheus
from ..serving.load import random_load_args, run_load
from ..serving.model import write_serving_model
from ..serving.servers import ProxySpec, Server, Servers, ServerSpec

LOCAL = "vllm:prompt_tokens_by_source_total"


def _fleet(servers: Servers, model: str, tag: str, spin_s) -> Dict[str, Server]:
    common = dict(threads=1, shm_busy_loop_s=spin_s)
    p = servers.add(ServerSpec(f"P-{tag}", model, role="prefill", **common))
    d = servers.add(ServerSpec(f"D-{tag}", model, role="decode", lease_s=30.0, **common))
    mono = servers.add(ServerSpec(f"mono-{tag}", model, role="monolithic", **common))
    proxy = servers.add(ProxySpec(f"proxy-{tag}", [p], [d], order="concurrent"))
    return {"mono": mono, "1P1D": proxy, "decode": d}


def main(argv: List[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--short-spin-s", type=float, default=0.002)
    ap.add_argument("--out", default="serving-stalls.json")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="kvops-stalls-")
    model = os.path.join(work, "model")
    write_serving_model(model)
    servers = Servers(os.path.join(work, "logs"))
    records: List[dict] = []
    with servers:
        fleets = {"vLLM spin 1 s": _fleet(servers, model, "spin", None),
                  f"spin {args.short_spin_s * 1e3:g} ms": _fleet(servers, model, "short",
                                                                  args.short_spin_s)}
        servers.start_all(900)
        for rep in range(args.reps):
            for fleet_name, fleet in fleets.items():
                for kind in ("mono", "1P1D"):
                    for conc in (4, 8):
                        load = random_load_args(model=model, output_len=6, max_concurrency=conc,
                                                num_prompts=args.requests, input_len=650,
                                                range_ratio=0.7, seed=rep)
                        local_before = prometheus.total(fleet["decode"].metrics(), LOCAL,
                                                        source="local_compute")
                        got = run_load(fleet[kind].url, load,
                                       log_path=os.path.join(work, "logs", "load.log"))
                        local = prometheus.total(fleet["decode"].metrics(), LOCAL,
                                                 source="local_compute") - local_before
                        if kind == "1P1D" and local > args.requests:
                            raise RuntimeError(f"{fleet_name}: D computed {local} prompt tokens "
                                               f"for {args.requests} requests: the KV did not "
                                               "come from P")
                        if any(got["errors"]):
                            raise RuntimeError(f"{fleet_name} {kind}: failed requests {got['errors']}")
                        records.append({"fleet": fleet_name, "server": kind, "concurrency": conc,
                                        "rep": rep, "wall_s": got["duration"],
                                        "ttft_p50_s": statistics.median(got["ttfts"]),
                                        "ttft_max_s": max(got["ttfts"])})
                        print(_line(records[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
    print(summary(records))


def _line(r: dict) -> str:
    return (f"{r['fleet']:>14s} {r['server']:>4s} c{r['concurrency']} rep {r['rep']}: wall "
            f"{r['wall_s']:.2f} s, TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms, max "
            f"{r['ttft_max_s'] * 1e3:.0f} ms")


def summary(records: List[dict]) -> str:
    """Markdown table: per fleet and concurrency, medians (min-max) of wall time and
    TTFT p50 for mono and 1P1D, and the ratios of the medians."""
    groups: Dict[Tuple[str, int, str], List[dict]] = {}
    for r in records:
        groups.setdefault((r["fleet"], r["concurrency"], r["server"]), []).append(r)

    def med(key, field):
        values = [r[field] for r in groups[key]]
        return statistics.median(values), min(values), max(values)

    lines = ["| fleet | concurrency | mono wall s | 1P1D wall s | wall ratio | mono TTFT p50 ms "
             "| 1P1D TTFT p50 ms | 1P1D TTFT max ms |", "|---|---|---|---|---|---|---|---|"]
    for fleet, conc in sorted({(f, c) for f, c, _ in groups}):
        mw, pw = med((fleet, conc, "mono"), "wall_s"), med((fleet, conc, "1P1D"), "wall_s")
        mt, pt = med((fleet, conc, "mono"), "ttft_p50_s"), med((fleet, conc, "1P1D"), "ttft_p50_s")
        px = med((fleet, conc, "1P1D"), "ttft_max_s")
        lines.append(f"| {fleet} | {conc} | {mw[0]:.2f} ({mw[1]:.2f}-{mw[2]:.2f}) | {pw[0]:.2f} "
                     f"({pw[1]:.2f}-{pw[2]:.2f}) | {pw[0] / mw[0]:.2f} | {mt[0] * 1e3:.0f} | "
                     f"{pt[0] * 1e3:.0f} ({pt[1] * 1e3:.0f}-{pt[2] * 1e3:.0f}) | {px[0] * 1e3:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
