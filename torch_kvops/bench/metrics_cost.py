"""What the vLLM connector's metrics (torch_kvops/integrations/vllm/metrics.py) cost on
the push path: real push steps (producer here, consumer process, Mooncake TCP), each
followed by what the vLLM worker does per step with metrics (the step's samples into
the collector, then the interval's stats, as vLLM asks every step) or without (nothing),
interleaved. Also the collector's own time per step, measured directly.

    python -m torch_kvops.bench.metrics_cost [--layers 16 --blocks 32 --rounds 30]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import numpy as np
import torch

from ..connector import ConnectorConfig, LayerwiseConnector
from ..plan import TransferRequest
from ..testing.consumer_process import ConsumerProcess
from ..transports.mooncake import MooncakeTransport


def _spread(values: List[float]) -> Dict[str, float]:
    q = np.percentile(values, [25, 50, 75])
    return {"median": float(q[1]), "p25": float(q[0]), "p75": float(q[2]),
            "min": float(min(values)), "max": float(max(values)), "n": len(values)}


def run(layers: int = 16, blocks: int = 32, block_floats: int = 32768, rounds: int = 30,
        polls_per_step: int = 4) -> Dict[str, object]:
    """``polls_per_step``: extra ``get_kv_connector_stats`` calls per push step (vLLM
    asks after every engine step, most of which push nothing)."""
    from ..integrations.vllm.metrics import StatsCollector  # needs vLLM

    pool = blocks * 2
    consumer = ConsumerProcess(layers, pool, (block_floats,), transfer_timeout_s=30.0)
    transport = MooncakeTransport(host="127.0.0.1")
    step_s: Dict[str, List[float]] = {"with_metrics": [], "without": []}
    collector_s: List[float] = []
    rng = np.random.default_rng(0)
    try:
        caches = [torch.randn(pool, block_floats) for _ in range(layers)]
        with LayerwiseConnector("producer", transport, ConnectorConfig(transfer_timeout_s=30.0)) as conn:
            conn.register_kv_caches(caches)
            peer = conn.add_peer(consumer.info)
            collector = StatsCollector("producer")
            for i in range(rounds + 1):  # round 0: warm-up
                for mode in (("with_metrics", "without") if i % 2 else ("without", "with_metrics")):
                    src = rng.choice(pool, blocks, replace=False).tolist()
                    dst = rng.choice(pool, blocks, replace=False).tolist()
                    consumer.call("expect", [f"{mode}-{i}"])  # not timed
                    t0 = time.perf_counter()
                    conn.start_step([TransferRequest(f"{mode}-{i}", peer, src, dst)])
                    for layer, cache in enumerate(caches):
                        conn.save_kv_layer(layer, cache)
                    forward_end = time.perf_counter()
                    conn.wait_for_save(timeout=60)
                    t1 = time.perf_counter()
                    if mode == "with_metrics":  # what KvopsWorker does after wait_for_save
                        collector.on_step(conn.last_step_trace(), t1 - forward_end)
                        for _ in range(1 + polls_per_step):
                            collector.take(conn.stats)
                        collector.touch()  # the step's outcome arrives in a later get_finished
                        collector.take(conn.stats)
                    t2 = time.perf_counter()
                    if i:
                        step_s[mode].append(t2 - t0)
                        if mode == "with_metrics":
                            collector_s.append(t2 - t1)
                    deadline = time.monotonic() + 30
                    while f"{mode}-{i}" not in conn.get_finished()[0]:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"push {mode}-{i} did not finish")
                        time.sleep(0.001)
    finally:
        consumer.stop()
        transport.close()
    with_m, without = _spread(step_s["with_metrics"]), _spread(step_s["without"])
    # same round, back to back (order alternating): most of the machine's drift cancels
    paired = [a - b for a, b in zip(step_s["with_metrics"], step_s["without"])]
    return {"layers": layers, "blocks_per_layer": blocks, "bytes_per_step": layers * blocks * block_floats * 4,
            "rounds": rounds, "polls_per_step": polls_per_step, "load_average": os.getloadavg(),
            "step_s": {"with_metrics": with_m, "without": without},
            "median_ratio": with_m["median"] / without["median"],
            "paired_difference_s": _spread(paired),
            "collector_s_per_step": _spread(collector_s),
            "collector_fraction_of_step": statistics.median(collector_s) / without["median"]}


def print_table(r: Dict[str, object]) -> None:
    print(f"push steps of {r['layers']} layers x {r['blocks_per_layer']} fragmented blocks "
          f"({r['bytes_per_step'] / 2**20:.0f} MiB), {r['rounds']} interleaved rounds, load {r['load_average'][0]:.1f}")
    for mode, s in r["step_s"].items():
        print(f"  {mode:13} median {s['median'] * 1e3:8.2f} ms  IQR [{s['p25'] * 1e3:.2f}, {s['p75'] * 1e3:.2f}]")
    d = r["paired_difference_s"]
    print(f"  paired (same round) with - without: median {d['median'] * 1e3:+.2f} ms, "
          f"IQR [{d['p25'] * 1e3:+.2f}, {d['p75'] * 1e3:+.2f}]")
    c = r["collector_s_per_step"]
    print(f"  with / without (medians): {r['median_ratio']:.3f}; the collector itself: median "
          f"{c['median'] * 1e6:.0f} us per step ({100 * r['collector_fraction_of_step']:.2f}% of a step)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--blocks", type=int, default=32)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = run(args.layers, args.blocks, rounds=args.rounds)
    print_table(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
