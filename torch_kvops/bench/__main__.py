"""``python -m torch_kvops.bench [--quick] [--only ops,cuda,transfer,overlap]``

Runs the op benchmarks (CPU; CUDA copies against C++ baselines where a GPU exists),
the transfer benchmarks and the layer-wise overlap
benchmark. Every figure is a ratio against a baseline measured in the same run, plus
absolute numbers labelled with the machine. Writes ``bench-results.json`` and a
timeline PNG of one prefill step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from . import cuda_copy as cuda_bench  # noqa: E402
from . import ops as ops_bench  # noqa: E402
from . import overlap as overlap_bench  # noqa: E402
from . import transfer as transfer_bench  # noqa: E402
from .common import machine  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="torch_kvops benchmarks")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (under a minute or two)")
    p.add_argument("--only", default="ops,cuda,transfer,overlap")
    p.add_argument("--out", default="bench-results.json")
    p.add_argument("--timeline", default="timeline.png")
    args = p.parse_args(argv)
    wanted = set(args.only.split(","))
    results = {"machine": machine(), "quick": args.quick, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
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
    if "transfer" in wanted:
        print("\n== layer-wise push over Mooncake TCP: contiguous vs fragmented blocks")
        results["transfer"] = transfer_bench.run(args.quick)
        transfer_bench.print_table(results["transfer"])
    if "overlap" in wanted:
        print("\n== layer-wise push vs push after the forward (paged Llama, two processes)")
        overlap = overlap_bench.run(args.quick)
        from ..demo import print_report

        print_report(overlap)
        results["overlap"] = overlap
        results["timeline_png"] = overlap_bench.plot_timeline(overlap, args.timeline)
        print(f"timeline: {results['timeline_png']}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
