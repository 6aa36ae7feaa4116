"""KV offloading jobs (``torch_kvops.offload``, the worker under vLLM's
``KvopsOffloadingSpec``) against the limit and, on CUDA, vLLM's batched DMA.

A job is what vLLM's OffloadingConnector hands the worker: ``blocks`` fragmented engine
blocks of ``layers`` layers (one descriptor per layer and block) to or from as many
fragmented host-tier chunks. Pages of 2-64 KiB, 1 to 10240 descriptors. Cases,
interleaved in rounds, each timed from submission until the copy is complete:

- ``store`` / ``load``: a whole job through ``HostTierMover`` (descriptor building, one
  ``swap_blocks_batch.ptrs`` call, completion; on CUDA the mover's side streams);
- ``contiguous``: one copy of the same number of bytes between the same memories (the
  limit; on CUDA device-to-host and host-to-device separately);
- CUDA only, ``dma_store`` / ``dma_load``: the same descriptors through one
  ``cuMemcpyBatchAsync`` call on a side stream (``_C._bench_memcpy_batch``: vLLM's
  ``swap_blocks_batch`` DMA path).

Every figure is a median with its interquartile range; ratios are against the limit and
the DMA path measured in the same run. Both jobs are checked byte for byte afterwards.
The CPU part has run (docs/benchmarks.md); the CUDA part is written, **not run yet**
(no GPU in the session that wrote it).
"""
from __future__ import annotations

import itertools
import os
from typing import Callable, Dict, List, Optional

import torch

from .. import _C
from ..offload import GroupRef, HostTierMover, build_host_tier
from .common import gbps, interleaved_samples, median_iqr

KIB, MIB = 1024, 1024 * 1024
PAGES_KIB = (2, 4, 16, 32, 64)
SHAPES = ((1, 1), (32, 4), (32, 32), (32, 320))  # (layers, blocks): 1 to 10240 descriptors


def _filled(shape, device: torch.device, pinned: bool = False, seed: int = 0) -> torch.Tensor:
    """Random bytes: untouched memory maps the zero page and reads at a speed no KV cache has."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    if device.type != "cpu":
        return t.to(device)
    return t.pin_memory() if pinned else t


def _repeats(nbytes: int, quick: bool) -> int:
    if quick:
        return 5
    return 41 if nbytes < MIB else 21 if nbytes < 32 * MIB else 11


def scenario(page: int, layers: int, blocks: int, device: torch.device, repeats: int,
             seed: int = 0) -> Dict[str, object]:
    on_device = device.type != "cpu"
    pool = max(2 * blocks, 4)
    engine = [_filled((pool, page), device, seed=seed + i) for i in range(layers)]
    tier = build_host_tier(engine, [page] * layers, [[GroupRef(i, page) for i in range(layers)]],
                           num_chunks=pool, blocks_per_chunk=1)
    for i, h in enumerate(tier.host):
        h.copy_(_filled(h.shape, torch.device("cpu"), seed=seed + 100 + i))
    mover = HostTierMover(tier)
    g = torch.Generator().manual_seed(seed + 7)
    engine_blocks = torch.randperm(pool, generator=g)[:blocks].tolist()
    chunks = torch.randperm(pool, generator=g)[:blocks].tolist()
    job = (engine_blocks, [blocks], [0], chunks)
    nbytes = layers * blocks * page
    job_ids = itertools.count()

    def run_job(kind: str) -> Callable[[], None]:
        submit = mover.store if kind == "store" else mover.load

        def run() -> None:
            job_id = next(job_ids)
            submit(job_id, *job)
            mover.wait({job_id})
            mover.finished()
        return run

    engine_flat = _filled((nbytes,), device, seed=seed + 200)
    host_flat = _filled((nbytes,), torch.device("cpu"), pinned=on_device, seed=seed + 201)
    cases: Dict[str, Callable[[], None]] = {"store": run_job("store"), "load": run_job("load")}
    side: Optional[torch.cuda.Stream] = None
    if on_device:
        side = torch.cuda.Stream(device)
        store_descs = mover.descriptors(*job, to_host=True)
        load_descs = mover.descriptors(*job, to_host=False)

        def on_side(fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                with torch.cuda.stream(side):
                    fn()
            return run

        cases["contiguous_d2h"] = on_side(lambda: host_flat.copy_(engine_flat, non_blocking=True))
        cases["contiguous_h2d"] = on_side(lambda: engine_flat.copy_(host_flat, non_blocking=True))
        if hasattr(_C, "_bench_memcpy_batch"):
            cases["dma_store"] = on_side(lambda: _C._bench_memcpy_batch(
                store_descs.src, store_descs.dst, store_descs.sizes))
            cases["dma_load"] = on_side(lambda: _C._bench_memcpy_batch(
                load_descs.src, load_descs.dst, load_descs.sizes))
        sync = torch.cuda.synchronize
    else:
        cases["contiguous"] = lambda: host_flat.copy_(engine_flat)
        sync = lambda: None  # noqa: E731  (host copies are complete on return)

    build_us = median_iqr(interleaved_samples(
        {"build": lambda: mover.descriptors(*job, to_host=True)}, repeats)["build"])[0] * 1e6
    samples = interleaved_samples(cases, repeats, sync=sync)
    _check(mover, job, engine_blocks, chunks, seed)
    mover.close()

    stats = {k: median_iqr(v) for k, v in samples.items()}
    med = {k: s[0] for k, s in stats.items()}
    limit = {"store": med.get("contiguous", med.get("contiguous_d2h")),
             "load": med.get("contiguous", med.get("contiguous_h2d"))}
    out: Dict[str, object] = {
        "page_kib": page // KIB, "layers": layers, "blocks": blocks, "descriptors": layers * blocks,
        "bytes": nbytes, "device": str(device), "repeats": repeats,
        "seconds": med, "iqr_seconds": {k: (s[1], s[2]) for k, s in stats.items()},
        "gbps": {k: gbps(nbytes, v) for k, v in med.items()},
        "descriptor_build_us": build_us,
        "store_vs_limit": limit["store"] / med["store"], "load_vs_limit": limit["load"] / med["load"],
    }
    if "dma_store" in med:
        out["store_vs_dma"] = med["dma_store"] / med["store"]
        out["load_vs_dma"] = med["dma_load"] / med["load"]
    return out


def _check(mover: HostTierMover, job, engine_blocks: List[int], chunks: List[int], seed: int) -> None:
    """The figures are only worth reading if the copies are right: store fresh bytes,
    wipe the engine blocks, load them back, compare."""
    tier = mover.tier
    block_idx = torch.tensor(engine_blocks, device=tier.device)
    fresh = [_filled((len(engine_blocks), e.shape[1]), tier.device, seed=seed + 300 + i)
             for i, e in enumerate(tier.engine)]
    for e, f in zip(tier.engine, fresh):
        e[block_idx] = f
    mover.store(-1, *job)
    mover.wait({-1})
    for e in tier.engine:
        e[block_idx] = 0
    mover.load(-2, *job)
    mover.wait({-2})
    mover.finished()
    if tier.device.type != "cpu":
        torch.cuda.synchronize(tier.device)
    for h, e, f in zip(tier.host, tier.engine, fresh):
        if not (torch.equal(h[chunks], f.cpu()) and torch.equal(e[block_idx].cpu(), f.cpu())):
            raise AssertionError("offload benchmark: a store or load moved the wrong bytes")


def run(quick: bool = False) -> Dict[str, object]:
    """CPU jobs always; CUDA jobs where a GPU exists."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    load_before = os.getloadavg()
    for device in devices:
        cap = (16 if quick else 192) * MIB if device.type == "cpu" else (64 if quick else 1024) * MIB
        for page_kib in PAGES_KIB:
            for layers, blocks in SHAPES:
                nbytes = layers * blocks * page_kib * KIB
                if nbytes > cap:
                    continue
                rows.append(scenario(page_kib * KIB, layers, blocks, device, _repeats(nbytes, quick)))
    return {"rows": rows, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "torch_threads": torch.get_num_threads(),
            "skipped": "jobs above the byte cap (CPU 192 MiB, CUDA 1 GiB; quick: 16 / 64 MiB)"}


def print_table(result: Dict[str, object]) -> None:
    print(f"load average before/after: {result['loadavg_before']} / {result['loadavg_after']}, "
          f"torch threads {result['torch_threads']}; skipped: {result['skipped']}")
    print(f"{'device':7} {'page':>6} {'descs':>6} {'MiB':>7} {'store GB/s':>11} {'x limit':>8} "
          f"{'load GB/s':>10} {'x limit':>8} {'limit GB/s':>11} {'DMA st/ld GB/s':>15} {'build us':>9}")
    for r in result["rows"]:
        g = r["gbps"]
        limit = g.get("contiguous", g.get("contiguous_d2h"))
        dma = f"{g['dma_store']:.1f}/{g['dma_load']:.1f}" if "dma_store" in g else "-"
        print(f"{r['device']:7} {r['page_kib']:>4}K {r['descriptors']:>6} {r['bytes'] / MIB:>7.2f} "
              f"{g['store']:>11.2f} {r['store_vs_limit']:>8.2f} {g['load']:>10.2f} "
              f"{r['load_vs_limit']:>8.2f} {limit:>11.2f} {dma:>15} {r['descriptor_build_us']:>9.0f}")
        spread = ", ".join(f"{k} {lo * 1e3:.3f}-{hi * 1e3:.3f}" for k, (lo, hi) in r["iqr_seconds"].items())
        print(f"        IQR ms: {spread}")
