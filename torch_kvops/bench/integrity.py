"""Cost of the end-to-end integrity check (``ConnectorConfig(integrity_check=True)``).

One producer pushes the same fragmented blocks to two consumer processes over Mooncake
TCP, one with the check on and one without, interleaved. A push is timed from the
producer's ``start_step`` to the moment the *consumer* reports the request finished
(after its verification), so both sides' hashing is inside the figure. Alongside: the
digest's own rate on one core (the same BlockDigester the connector uses).
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List

import numpy as np
import torch

from ..connector import ConnectorConfig, LayerwiseConnector
from ..connector.integrity import BlockDigester, integrity_key
from ..plan import TransferRequest
from ..testing.consumer_process import ConsumerProcess
from ..transports.mooncake import MooncakeTransport
from .common import gbps


def _push(conn: LayerwiseConnector, consumer: ConsumerProcess, caches, peer: str, src, dst,
          tag: str) -> float:
    consumer.call("expect", [tag])
    t0 = time.time()  # wall clock: the consumer process stamps its report with it
    conn.start_step([TransferRequest(tag, peer, src, dst)])
    for layer, cache in enumerate(caches):
        conn.save_kv_layer(layer, cache)
    conn.wait_for_save(timeout=120)
    finished, failed, times = consumer.call("wait", [tag], 120.0)
    if tag not in finished:
        raise RuntimeError(f"benchmark push {tag} did not finish (failed: {sorted(failed)})")
    conn.get_finished()
    return times[tag] - t0


def run(quick: bool = False) -> Dict[str, object]:
    layers, blocks, block_bytes = (8, 512, 16 << 10) if quick else (16, 1024, 16 << 10)
    repeats = 3 if quick else 7
    pool = blocks * 2
    shape = (block_bytes // 4,)
    config = dict(transfer_timeout_s=30.0, lease_s=120.0)
    plain = ConsumerProcess(layers, pool, shape, **config)
    checked = ConsumerProcess(layers, pool, shape, integrity_check=True, **config)
    transport = MooncakeTransport(host="127.0.0.1")
    times: Dict[str, List[float]] = {"off": [], "on": []}
    try:
        caches = [torch.randn(pool, *shape) for _ in range(layers)]
        with LayerwiseConnector("producer", transport, ConnectorConfig(**config)) as conn:
            conn.register_kv_caches(caches)
            peers = {"off": (plain, conn.add_peer(plain.info)), "on": (checked, conn.add_peer(checked.info))}
            rng = np.random.default_rng(0)
            for i in range(repeats + 1):  # first round: warm-up
                src = rng.choice(pool, blocks, replace=False).tolist()
                dst = rng.choice(pool, blocks, replace=False).tolist()
                order = ("off", "on") if i % 2 == 0 else ("on", "off")
                for name in order:
                    consumer, peer = peers[name]
                    t = _push(conn, consumer, caches, peer, src, dst, f"{name}-{i}")
                    if i:
                        times[name].append(t)
            producer_us = conn.stats()["integrity_us"]
        consumer_us = checked.call("stats")["integrity_us"]
    finally:
        plain.stop()
        checked.stop()
        transport.close()
    nbytes = layers * blocks * block_bytes
    digester = BlockDigester(caches, integrity_key("benchmark"))
    ids = list(range(blocks))
    t0 = time.perf_counter()
    digester.block_digests(ids)
    digest_s = time.perf_counter() - t0
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"layers": layers, "blocks_per_layer": blocks, "block_bytes": block_bytes, "bytes": nbytes,
            "repeats": repeats, "seconds": med,
            "spread_s": {k: [min(v), max(v)] for k, v in times.items()},
            "gbps": {k: gbps(nbytes, v) for k, v in med.items()},
            "throughput_on_over_off": med["off"] / med["on"],
            "digest_gbps_one_core": gbps(nbytes, digest_s),
            # hashing time per push, from the connectors' counters (warm-up included)
            "producer_digest_s_per_push": producer_us / 1e6 / (repeats + 1),
            "consumer_verify_s_per_push": consumer_us / 1e6 / (repeats + 1)}


def print_table(r: Dict[str, object]) -> None:
    print(f"push of {r['layers']} layers x {r['blocks_per_layer']} fragmented blocks x {r['block_bytes']} B "
          f"({r['bytes'] / 2**20:.0f} MiB), timed until the consumer reports it finished")
    for k in ("off", "on"):
        lo, hi = r["spread_s"][k]
        print(f"  integrity {k:3} {r['seconds'][k] * 1e3:8.1f} ms ({lo * 1e3:.1f}..{hi * 1e3:.1f}) "
              f"{r['gbps'][k]:6.2f} GB/s")
    print(f"  throughput with the check / without: {r['throughput_on_over_off']:.2f}x; "
          f"per push: producer digests {r['producer_digest_s_per_push'] * 1e3:.1f} ms (overlaps the "
          f"forward in layer-wise use), consumer verifies {r['consumer_verify_s_per_push'] * 1e3:.1f} ms")
    print(f"  HMAC-SHA256 digest on one core: {r['digest_gbps_one_core']:.2f} GB/s")
