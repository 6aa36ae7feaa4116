"""What a lane thread costs a step with one peer: the same push steps (producer here,
consumer process, Mooncake TCP) through a producer that runs a one-peer step on its
sender thread (``detach_slow_lanes_after_s=None``) and one that gives it a lane thread
it may leave to finish alone (the vLLM adapter's 0.5 s), interleaved step by step.
Each step's time runs from ``start_step`` to the request's outcome in ``get_finished``.

    python -m torch_kvops.bench.lane_cost [--layers 16 --blocks 8 --steps 130]
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import numpy as np
import torch

from ..connector import ConnectorConfig, LayerwiseConnector
from ..plan import TransferRequest
from ..testing.consumer_process import ConsumerProcess
from ..transports.mooncake import MooncakeTransport
from .metrics_cost import _spread

MODES = {"inline": None, "lane": 0.5}  # detach_slow_lanes_after_s


def run(layers: int = 16, blocks: int = 8, block_floats: int = 1024, steps: int = 130) -> Dict[str, object]:
    """Per mode: the spread of step times (seconds)."""
    pool = blocks * 4
    consumers, transports, conns, peers = {}, {}, {}, {}
    step_s: Dict[str, List[float]] = {mode: [] for mode in MODES}
    rng = np.random.default_rng(0)
    caches = [torch.randn(pool, block_floats) for _ in range(layers)]
    try:
        for mode, detach in MODES.items():
            consumers[mode] = ConsumerProcess(layers, pool, (block_floats,), transfer_timeout_s=30.0)
            transports[mode] = MooncakeTransport(host="127.0.0.1")
            conns[mode] = LayerwiseConnector("producer", transports[mode], ConnectorConfig(
                transfer_timeout_s=30.0, detach_slow_lanes_after_s=detach))
            conns[mode].register_kv_caches(caches)
            peers[mode] = conns[mode].add_peer(consumers[mode].info)
        for i in range(steps + 1):  # step 0: warm-up
            for mode in (list(MODES) if i % 2 else list(MODES)[::-1]):
                conn, req_id = conns[mode], f"{mode}-{i}"
                src = rng.choice(pool, blocks, replace=False).tolist()
                dst = rng.choice(pool, blocks, replace=False).tolist()
                consumers[mode].call("expect", [req_id])  # not timed
                t0 = time.perf_counter()
                conn.start_step([TransferRequest(req_id, peers[mode], src, dst)])
                for layer, cache in enumerate(caches):
                    conn.save_kv_layer(layer, cache)
                conn.wait_for_save(timeout=60)
                deadline = time.monotonic() + 30
                while req_id not in conn.get_finished()[0]:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"push {req_id} did not finish")
                    time.sleep(0.0002)
                if i:
                    step_s[mode].append(time.perf_counter() - t0)
    finally:
        for mode in list(conns):
            conns[mode].close()
        for mode in list(transports):
            transports[mode].close()
        for mode in list(consumers):
            consumers[mode].stop()
    out: Dict[str, object] = {mode: _spread(values) for mode, values in step_s.items()}
    out["lane_over_inline"] = out["lane"]["median"] / out["inline"]["median"]
    out["layers"], out["bytes_per_layer"] = layers, blocks * block_floats * 4
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=130)
    args = p.parse_args(argv)
    print(json.dumps(run(args.layers, args.blocks, steps=args.steps), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
