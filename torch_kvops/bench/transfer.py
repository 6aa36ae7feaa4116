"""Layer-wise push over Mooncake TCP (loopback, two processes): contiguous blocks vs
the same bytes as fragmented blocks, and a sweep of the transport's batch size. Inside
an emulated link (``python -m torch_kvops.bench --only transfer --link 1gbit``) the pushes
are sized to take about a second at the link's rate and reported against it."""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import numpy as np
import torch

from ..connector import ConnectorConfig, LayerwiseConnector
from ..emulated_link import LinkSpec
from ..plan import TransferRequest
from ..testing.consumer_process import ConsumerProcess
from ..transports.mooncake import MooncakeTransport
from .common import gbps


def _push_once(conn: LayerwiseConnector, consumer: ConsumerProcess, caches, peer: str, src, dst,
               tag: str) -> float:
    consumer.call("expect", [tag])  # as a decode engine does before its KV comes (not timed)
    t0 = time.perf_counter()
    conn.start_step([TransferRequest(tag, peer, src, dst)])
    for layer, cache in enumerate(caches):
        conn.save_kv_layer(layer, cache)
    conn.wait_for_save(timeout=120)
    elapsed = time.perf_counter() - t0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished, failed = conn.get_finished()
        if failed:
            raise RuntimeError(f"benchmark transfer {tag} failed")
        if tag in finished:
            return elapsed
        time.sleep(0.001)
    raise TimeoutError(f"benchmark transfer {tag} never finished")


def contiguous_vs_fragmented(layers: int, blocks: int, block_bytes: int, repeats: int,
                             transport_kwargs: Dict[str, object],
                             staging: bool = True) -> Dict[str, object]:
    pool = blocks * 2
    shape = (block_bytes // 4,)
    config = dict(transfer_timeout_s=30.0)
    if not staging:
        config["staging_threshold_bytes"] = 0
    consumer = ConsumerProcess(layers, pool, shape, transport_kwargs=transport_kwargs, **config)
    transport = MooncakeTransport(host="127.0.0.1", **transport_kwargs)
    try:
        caches = [torch.randn(pool, *shape) for _ in range(layers)]
        with LayerwiseConnector("producer", transport, ConnectorConfig(**config)) as conn:
            conn.register_kv_caches(caches)
            peer = conn.add_peer(consumer.info)
            rng = np.random.default_rng(0)
            contiguous = (list(range(blocks)), list(range(blocks)))
            fragmented = (rng.choice(pool, blocks, replace=False).tolist(),
                          rng.choice(pool, blocks, replace=False).tolist())
            times: Dict[str, List[float]] = {"contiguous": [], "fragmented": []}
            for i in range(repeats + 1):  # alternate, first round is warm-up
                for name, (src, dst) in (("contiguous", contiguous), ("fragmented", fragmented)):
                    t = _push_once(conn, consumer, caches, peer, src, dst, f"{name}-{i}")
                    if i:
                        times[name].append(t)
    finally:
        consumer.stop()
        transport.close()
    nbytes = layers * blocks * block_bytes
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"layers": layers, "blocks_per_layer": blocks, "block_bytes": block_bytes,
            "bytes": nbytes, "transport": transport_kwargs, "staging": staging, "seconds": med,
            "gbps": {k: gbps(nbytes, v) for k, v in med.items()},
            "fragmented_over_contiguous_throughput": med["contiguous"] / med["fragmented"]}


def over_link(link: LinkSpec, seconds: float, repeats: int, layers: int = 8,
              block_bytes: int = 16 << 10) -> Dict[str, object]:
    """Contiguous vs fragmented pushes sized to take ~``seconds`` at the link's rate,
    with the achieved rate as a fraction of the link's (``link_utilization``)."""
    blocks = int(min(4096, max(64, link.rate_bit_s / 8 * seconds / (layers * block_bytes))))
    result = contiguous_vs_fragmented(layers, blocks, block_bytes, repeats, {})
    result["link"] = {"rate_gbit_s": link.rate_gbit_s, "delay_ms": link.delay_s * 1e3}
    result["link_utilization"] = {k: v * 8e9 / link.rate_bit_s for k, v in result["gbps"].items()}
    return result


def run(quick: bool = False, link: Optional[LinkSpec] = None) -> Dict[str, object]:
    """Staged (the default) contiguous vs fragmented pushes, then the direct path
    (staging off) over a sweep of the transport's in-flight descriptor window. Inside an
    emulated ``link``: the pushes against the link's rate only (the sweep measures the
    transport's per-descriptor cost, which a slower link hides)."""
    if link is not None:
        return {"contiguous_vs_fragmented": over_link(link, 0.5 if quick else 1.0,
                                                      2 if quick else 5)}
    repeats = 2 if quick else 5
    layers, blocks = (8, 1024) if quick else (16, 2048)
    main = contiguous_vs_fragmented(layers, blocks, 16 << 10, repeats, {})
    sweep = []
    for batch in ((64, 256) if quick else (16, 64, 256, 1024)):
        r = contiguous_vs_fragmented(layers // 2, blocks, 16 << 10, max(1, repeats // 2),
                                     {"max_batch_descriptors": batch}, staging=False)
        sweep.append({"max_batch_descriptors": batch, "fragmented_gbps": r["gbps"]["fragmented"],
                      "contiguous_gbps": r["gbps"]["contiguous"],
                      "ratio": r["fragmented_over_contiguous_throughput"]})
    return {"contiguous_vs_fragmented": main, "direct_batch_sweep": sweep}


def print_table(result: Dict[str, object]) -> None:
    m = result["contiguous_vs_fragmented"]
    print(f"push of {m['layers']} layers x {m['blocks_per_layer']} blocks x {m['block_bytes']} B "
          f"({m['bytes'] / 2**20:.0f} MiB) over Mooncake TCP loopback")
    for k in ("contiguous", "fragmented"):
        print(f"  {k:11} {m['seconds'][k] * 1e3:9.1f} ms {m['gbps'][k]:7.2f} GB/s")
    print(f"  fragmented / contiguous throughput: {m['fragmented_over_contiguous_throughput']:.2f}x "
          "(fragmented layers go through staging)")
    if "link" in m:
        print(f"  over an emulated {m['link']['rate_gbit_s']:g} Gbit/s link: "
              + ", ".join(f"{k} {v:.2f}x of its rate" for k, v in m["link_utilization"].items()))
        return
    print("  direct path, no staging (max_batch_descriptors: fragmented GB/s, contiguous GB/s, ratio)")
    for s in result["direct_batch_sweep"]:
        print(f"    {s['max_batch_descriptors']:5}: {s['fragmented_gbps']:.2f} {s['contiguous_gbps']:.2f} "
              f"{s['ratio']:.2f}")
