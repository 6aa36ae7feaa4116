"""Cost of the end-to-end integrity check (``ConnectorConfig(integrity_check=...)``).

One producer pushes the same fragmented blocks to three consumer processes over
Mooncake TCP, one per mode ("off", "checksum", "mac"; each consumer asks for its mode),
in rotating order, round after round. A push is timed from the producer's
``start_step`` to the moment the *consumer* reports the request finished (after its
verification of the last layer), so both sides' hashing is inside the figure.

Alongside, the digest rates the choice of implementation rests on, over the same
blocks (one call per block where the implementation is a Python library): the native
``kvops::block_digests`` (one thread and torch's threads) against XXH3-128 (``xxhash``)
for "checksum"; keyed BLAKE3 (``blake3``) against AES-GCM used as GMAC
(``cryptography``) for "mac".
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from ..connector import ConnectorConfig, LayerwiseConnector
from ..connector.integrity import ChecksumDigester, MacDigester, integrity_key
from ..plan import TransferRequest
from ..testing.consumer_process import ConsumerProcess
from ..transports.mooncake import MooncakeTransport
from .common import gbps

MODES = ("off", "checksum", "mac")


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


def _best_rate(nbytes: int, fn: Callable[[], object], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return gbps(nbytes, best)


def digest_rates(caches: List[torch.Tensor], blocks: np.ndarray) -> Dict[str, Optional[float]]:
    """GB/s of each candidate over ``blocks`` of every layer (None: library not installed)."""
    nbytes = len(caches) * blocks.size * caches[0][0].numel() * caches[0].element_size()
    checksum, mac = ChecksumDigester(caches), MacDigester(caches, integrity_key("benchmark"))
    views = [c.view(c.size(0), -1).view(torch.uint8).numpy() for c in caches]
    ids = blocks.tolist()
    rates: Dict[str, Optional[float]] = {}
    ids_t = torch.from_numpy(blocks.astype(np.int64))
    rates["native_crc32c_1_thread"] = _best_rate(
        nbytes, lambda: [checksum.layer_digests(i, blocks) for i in range(len(caches))])
    rates[f"native_crc32c_parallel_{torch.get_num_threads()}_threads"] = _best_rate(
        nbytes, lambda: [torch.ops.kvops.block_digests(c, ids_t, i, True) for i, c in enumerate(caches)])
    try:
        import xxhash
        rates["xxh3_128_library"] = _best_rate(
            nbytes, lambda: [xxhash.xxh3_128_digest(v[b]) for v in views for b in ids])
    except ImportError:
        rates["xxh3_128_library"] = None
    rates["blake3_keyed_library"] = _best_rate(
        nbytes, lambda: [mac.layer_digests(i, blocks) for i in range(len(caches))])
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        gcm, prefix = AESGCM(os.urandom(32)), os.urandom(8)
        rates["aes_gmac_library"] = _best_rate(
            nbytes, lambda: [gcm.encrypt(prefix + k.to_bytes(4, "little"), b"", v[b])
                             for v in views for k, b in enumerate(ids)])
    except ImportError:
        rates["aes_gmac_library"] = None
    return rates


def run(quick: bool = False) -> Dict[str, object]:
    layers, blocks, block_bytes = (8, 512, 16 << 10) if quick else (16, 1024, 16 << 10)
    repeats = 3 if quick else 9
    pool = blocks * 2
    shape = (block_bytes // 4,)
    config = dict(transfer_timeout_s=30.0, lease_s=120.0)
    consumers = {}
    transport = MooncakeTransport(host="127.0.0.1")
    times: Dict[str, List[float]] = {m: [] for m in MODES}
    try:
        for mode in MODES:
            consumers[mode] = ConsumerProcess(layers, pool, shape, integrity_check=mode, **config)
        caches = [torch.randn(pool, *shape) for _ in range(layers)]
        with LayerwiseConnector("producer", transport, ConnectorConfig(**config)) as conn:
            conn.register_kv_caches(caches)
            peers = {m: conn.add_peer(c.info) for m, c in consumers.items()}
            rng = np.random.default_rng(0)
            for i in range(repeats + 1):  # first round: warm-up
                src = rng.choice(pool, blocks, replace=False).tolist()
                dst = rng.choice(pool, blocks, replace=False).tolist()
                order = MODES[i % 3:] + MODES[:i % 3]
                for mode in order:
                    t = _push(conn, consumers[mode], caches, peers[mode], src, dst, f"{mode}-{i}")
                    if i:
                        times[mode].append(t)
            producer_us = conn.stats()["integrity_us"]
        consumer_us = {m: consumers[m].call("stats")["integrity_us"] for m in ("checksum", "mac")}
    finally:
        for consumer in consumers.values():
            consumer.stop()
        transport.close()
    nbytes = layers * blocks * block_bytes
    med = {k: statistics.median(v) for k, v in times.items()}
    rates = digest_rates(caches, np.random.default_rng(1).choice(pool, blocks, replace=False))
    return {"layers": layers, "blocks_per_layer": blocks, "block_bytes": block_bytes, "bytes": nbytes,
            "repeats": repeats, "seconds": med,
            "spread_s": {k: [min(v), max(v)] for k, v in times.items()},
            "gbps": {k: gbps(nbytes, v) for k, v in med.items()},
            "throughput_over_off": {m: med["off"] / med[m] for m in ("checksum", "mac")},
            "goals": {"checksum": 0.90, "mac": 0.70},
            "digest_gbps": rates,
            # hashing time per push from the counters (warm-up included); the producer's
            # runs on its digest worker, overlapped with the next layer's write
            "producer_digest_s_per_push": producer_us / 1e6 / (2 * (repeats + 1)),
            "consumer_verify_s_per_push": {m: us / 1e6 / (repeats + 1) for m, us in consumer_us.items()}}


def print_table(r: Dict[str, object]) -> None:
    print(f"push of {r['layers']} layers x {r['blocks_per_layer']} fragmented blocks x {r['block_bytes']} B "
          f"({r['bytes'] / 2**20:.0f} MiB), timed until the consumer reports it finished, "
          f"median of {r['repeats']} interleaved rounds (min..max)")
    for k in MODES:
        lo, hi = r["spread_s"][k]
        ratio = "" if k == "off" else (f"  {r['throughput_over_off'][k]:.2f}x of off "
                                       f"(goal >= {r['goals'][k]:.2f}x)")
        print(f"  integrity {k:8} {r['seconds'][k] * 1e3:8.1f} ms ({lo * 1e3:.1f}..{hi * 1e3:.1f}) "
              f"{r['gbps'][k]:6.2f} GB/s{ratio}")
    verify = r["consumer_verify_s_per_push"]
    print(f"  hashing per push: producer {r['producer_digest_s_per_push'] * 1e3:.1f} ms (mean over both "
          f"modes, overlapped with the writes), consumer checksum {verify['checksum'] * 1e3:.1f} ms, "
          f"mac {verify['mac'] * 1e3:.1f} ms (overlapped with the layers still landing)")
    print("  digest rates over the same blocks (GB/s; libraries: one call per block):")
    for name, rate in r["digest_gbps"].items():
        print(f"    {name:28} {'not installed' if rate is None else f'{rate:6.2f}'}")
