"""Where 1P1D serving loses time on a small CPU host (issue 23, "find the stalls"):
one monolithic server against 1P1D (our proxy, concurrent dispatch) at concurrency 4
and 8 on loopback, with vLLM's message-queue busy-spin as shipped (1 s after every
step) and shortened (``--short-spin-s``, default 2 ms; serving/shm_spin/).

    python -m torch_kvops.bench.serving_stalls [--reps 3] [--requests 16] [--out FILE]

Two fleets (one per spin setting: mono, and a P + D + proxy per ``--idle-waits``
setting of the connector's ``idle_step_wait_s``), started once; every repetition loads
every (fleet, server, concurrency) in turn with the same prompts (vLLM's random dataset,
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


def _fleet(servers: Servers, model: str, tag: str, spin_s, idle_waits: List[float]
           ) -> Dict[str, Tuple[Server, Server]]:
    """{server kind: (front, decode server or None)}: one monolithic server, and a P/D
    pair behind a proxy per ``idle_step_wait_s`` setting."""
    common = dict(threads=1, shm_busy_loop_s=spin_s)
    fleet = {"mono": (servers.add(ServerSpec(f"mono-{tag}", model, role="monolithic", **common)),
                      None)}
    for wait in idle_waits:
        extra = {"idle_step_wait_s": wait}
        name = f"{tag}-w{wait * 1e3:g}"
        p = servers.add(ServerSpec(f"P-{name}", model, role="prefill", kv_connector_extra_config=extra,
                                   **common))
        d = servers.add(ServerSpec(f"D-{name}", model, role="decode", lease_s=30.0,
                                   kv_connector_extra_config=extra, **common))
        fleet[f"1P1D wait {wait * 1e3:g} ms"] = (
            servers.add(ProxySpec(f"proxy-{name}", [p], [d], order="concurrent")), d)
    return fleet


def main(argv: List[str] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--short-spin-s", type=float, default=0.002)
    ap.add_argument("--idle-waits", default="0,0.005",
                    help="idle_step_wait_s of each P/D pair, comma-separated (0: none)")
    ap.add_argument("--out", default="serving-stalls.json")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="kvops-stalls-")
    model = os.path.join(work, "model")
    write_serving_model(model)
    servers = Servers(os.path.join(work, "logs"))
    records: List[dict] = []
    with servers:
        waits = [float(w) for w in args.idle_waits.split(",")]
        fleets = {"vLLM spin 1 s": _fleet(servers, model, "spin", None, waits),
                  f"spin {args.short_spin_s * 1e3:g} ms": _fleet(servers, model, "short",
                                                                  args.short_spin_s, waits)}
        servers.start_all(900)
        for rep in range(args.reps):
            for fleet_name, fleet in fleets.items():
                for kind, (front, decode) in fleet.items():
                    for conc in (4, 8):
                        load = random_load_args(model=model, output_len=6, max_concurrency=conc,
                                                num_prompts=args.requests, input_len=650,
                                                range_ratio=0.7, seed=rep)
                        local_before = 0.0 if decode is None else prometheus.total(
                            decode.metrics(), LOCAL, source="local_compute")
                        got = run_load(front.url, load,
                                       log_path=os.path.join(work, "logs", "load.log"))
                        local = 0.0 if decode is None else prometheus.total(
                            decode.metrics(), LOCAL, source="local_compute") - local_before
                        if local > args.requests:
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

    lines = ["| fleet | P/D | concurrency | mono wall s | P/D wall s | wall ratio | mono TTFT p50 ms "
             "| P/D TTFT p50 ms | P/D TTFT max ms |", "|---|---|---|---|---|---|---|---|---|"]
    for fleet, conc, kind in sorted(k for k in groups if k[2] != "mono"):
        mw, pw = med((fleet, conc, "mono"), "wall_s"), med((fleet, conc, kind), "wall_s")
        mt, pt = med((fleet, conc, "mono"), "ttft_p50_s"), med((fleet, conc, kind), "ttft_p50_s")
        px = med((fleet, conc, kind), "ttft_max_s")
        lines.append(f"| {fleet} | {kind} | {conc} | {mw[0]:.2f} ({mw[1]:.2f}-{mw[2]:.2f}) | "
                     f"{pw[0]:.2f} ({pw[1]:.2f}-{pw[2]:.2f}) | {pw[0] / mw[0]:.2f} | "
                     f"{mt[0] * 1e3:.0f} | {pt[0] * 1e3:.0f} ({pt[1] * 1e3:.0f}-{pt[2] * 1e3:.0f}) | "
                     f"{px[0] * 1e3:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
