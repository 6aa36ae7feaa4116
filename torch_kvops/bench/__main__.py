"""``python -m torch_kvops.bench [--quick] [--only ops,cuda,offload,transfer,integrity,overlap,metrics]
[--redraw RESULTS_JSON] [--link RATE[,DELAY]]``

Runs the op benchmarks (CPU; CUDA copies against C++ baselines where a GPU exists),
the KV offloading jobs (CPU; CUDA where a GPU exists), the transfer benchmarks, the
cost of the integrity check and the layer-wise overlap benchmark. Every figure is a ratio against a baseline measured in the same run, plus
absolute numbers labelled with the machine. Writes ``bench-results.json``, then a
timeline PNG of one prefill step (needs matplotlib: ``pip install 'torch_kvops[plot]'``;
without it the PNG is skipped with a note, and the run still succeeds).

``--link 1gbit`` runs the benchmarks inside a network namespace whose loopback is
shaped to that rate (torch_kvops/emulated_link.py; needs root): the transfer benchmark
then reports the pushes against the link's rate.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Optional

from . import cuda_copy as cuda_bench
from . import integrity as integrity_bench
from . import offload as offload_bench
from . import ops as ops_bench
from . import overlap as overlap_bench
from . import transfer as transfer_bench
from .common import machine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="torch_kvops benchmarks")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (under a minute or two)")
    p.add_argument("--only", default="ops,cuda,offload,transfer,integrity,overlap")
    p.add_argument("--out", default="bench-results.json")
    p.add_argument("--timeline", default="timeline.png")
    p.add_argument("--redraw", metavar="RESULTS_JSON",
                   help="run nothing: draw the timeline from a results file written earlier")
    p.add_argument("--link", metavar="RATE[,DELAY]",
                   help="run inside an emulated link (network namespace, shaped loopback; root)")
    p.add_argument("--link-timeout", type=float, default=4 * 3600.0,
                   help="bound of the whole run inside the link, seconds")
    args = p.parse_args(argv)
    link = None
    if args.link:
        from ..emulated_link import enter_link

        link = enter_link(args.link, [sys.executable, "-m", "torch_kvops.bench",
                                      *(sys.argv[1:] if argv is None else argv)], args.link_timeout)
    if args.redraw:
        with open(args.redraw) as f:
            saved = json.load(f)
        if "overlap" not in saved:
            p.error(f"{args.redraw} holds no overlap results (run with --only overlap)")
        drawn = draw_timeline(saved["overlap"], args.timeline)
        if drawn:
            print(f"timeline: {drawn}")
        return 0
    wanted = set(args.only.split(","))
    unknown = wanted - {"ops", "cuda", "offload", "transfer", "integrity", "overlap", "metrics"}
    if unknown:
        p.error(f"--only: unknown benchmark(s) {sorted(unknown)}; choose from ops, cuda, offload, "
                "transfer, integrity, overlap, metrics")
    results = {"machine": machine(), "quick": args.quick, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "load_average": os.getloadavg()}
    if link is not None:
        results["link"] = {"rate_gbit_s": link.rate_gbit_s, "delay_ms": link.delay_s * 1e3}
    print(f"machine: {results['machine']}")
    if "ops" in wanted:
        print("\n== swap_blocks_batch vs hand-written copies (medians of interleaved runs)")
        results["ops"] = ops_bench.run(args.quick)
        ops_bench.print_table(results["ops"])
    if "cuda" in wanted:
        import torch

        if torch.cuda.is_available():
            print("\n== swap_blocks_batch on CUDA vs the limit and C++ baselines (medians, IQR)")
            results["cuda"] = cuda_bench.run(args.quick)
            cuda_bench.print_table(results["cuda"])
        else:
            print("\n== CUDA copies: skipped, torch.cuda.is_available() is False")
    if "offload" in wanted:
        print("\n== KV offloading jobs (KvopsOffloadingSpec's worker) vs one contiguous copy "
              "(and batched DMA on CUDA); medians, IQR")
        results["offload"] = offload_bench.run(args.quick)
        offload_bench.print_table(results["offload"])
    if "transfer" in wanted:
        print("\n== layer-wise push over Mooncake TCP: contiguous vs fragmented blocks"
              + (f" (emulated {link.text} link)" if link else ""))
        results["transfer"] = transfer_bench.run(args.quick, link)
        transfer_bench.print_table(results["transfer"])
    if "integrity" in wanted:
        print("\n== cost of the end-to-end integrity check (fragmented push, interleaved)")
        results["integrity"] = integrity_bench.run(args.quick)
        integrity_bench.print_table(results["integrity"])
    if "metrics" in wanted:  # not in the default set: needs vLLM
        from . import metrics_cost

        print("\n== the vLLM connector's metrics on the push path: with vs without (interleaved)")
        results["metrics"] = metrics_cost.run(rounds=10 if args.quick else 40)
        metrics_cost.print_table(results["metrics"])
    if "overlap" in wanted:
        print("\n== layer-wise push vs push after the forward (paged Llama, two processes)")
        overlap = overlap_bench.run(args.quick)
        from ..demo import print_report

        print_report(overlap)
        results["overlap"] = overlap
    # The numbers first: a failure while drawing must not lose a run that took minutes.
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {args.out}")
    if "overlap" in results:
        drawn = draw_timeline(results["overlap"], args.timeline)
        if drawn:
            print(f"timeline: {drawn}")
    return 0


def draw_timeline(overlap: dict, path: str) -> Optional[str]:
    """Draw the timeline PNG; without matplotlib say so and return None."""
    if importlib.util.find_spec("matplotlib") is None:
        print(f"timeline: skipped {path}: matplotlib is not installed "
              "(pip install 'torch_kvops[plot]' or matplotlib)")
        return None
    return overlap_bench.plot_timeline(overlap, path)


if __name__ == "__main__":
    sys.exit(main())
