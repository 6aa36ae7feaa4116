"""swap_blocks_batch on CUDA against the physical limit and against the copies the
engines write in C++, on the same descriptors, interleaved, timed with CUDA events.

Per scenario (H2D, D2H, D2D; fragmented 2, 16, 32 KiB blocks and 16 KiB blocks in runs
of 16 adjacent ones; 32 layers; torch's default (legacy) stream and a side stream):

- ``ours[auto]``, ``ours[kernel]``, ``ours[dma]``: the op under each copy policy;
- ``contiguous``: one copy of the same number of bytes (the physical limit);
- ``memcpy_loop``: one ``cudaMemcpyAsync`` per block, a C++ loop (vLLM's old
  ``swap_blocks``), ``_C._bench_memcpy_loop``;
- ``memcpy_batch``: ``cuMemcpyBatchAsync`` of the same descriptors (vLLM's current
  ``swap_blocks_batch``), side stream only (the API refuses the legacy stream);
- ``index_copy``: per-layer ``index_select`` + ``index_copy_`` (D2D only).

Each figure: median of interleaved rounds of (host submission + GPU time until the
stream's end event), with the interquartile range. Ratios against the limit and against
the strongest alternative (the fastest non-ours case other than ``contiguous``).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List

import torch

from .. import _C, ops
from ..policy import get_copy_policy, set_copy_policy
from .common import gbps

KIB = 1024


def _mapping(pool: int, rows: int, run: int, seed: int) -> torch.Tensor:
    """rows (src, dst) pairs: random blocks (run=1) or random runs of `run` adjacent blocks."""
    g = torch.Generator().manual_seed(seed)
    groups = rows // run
    starts_s = torch.randperm(pool // run, generator=g)[:groups] * run
    starts_d = torch.randperm(pool // run, generator=g)[:groups] * run
    off = torch.arange(run)
    src = (starts_s[:, None] + off).reshape(-1)
    dst = (starts_d[:, None] + off).reshape(-1)
    return torch.stack([src, dst], dim=1).to(torch.int64)


def _ptrs(src: List[torch.Tensor], dst: List[torch.Tensor], mapping: torch.Tensor):
    s_idx, d_idx = mapping[:, 0], mapping[:, 1]
    sp, dp = [], []
    for s, d in zip(src, dst):
        sb, db = s.stride(0) * s.element_size(), d.stride(0) * d.element_size()
        sp.append(s.data_ptr() + s_idx * sb)
        dp.append(d.data_ptr() + d_idx * db)
    block = src[0][0].numel() * src[0].element_size()
    sp, dp = torch.cat(sp), torch.cat(dp)
    return sp, dp, torch.full_like(sp, block)


def _time_cases(cases: Dict[str, Callable[[], None]], stream: torch.cuda.Stream,
                repeats: int) -> Dict[str, List[float]]:
    for fn in cases.values():  # warm-up (also builds pinned rings, resolves entry points)
        with torch.cuda.stream(stream):
            fn()
    torch.cuda.synchronize()
    samples: Dict[str, List[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            end = torch.cuda.Event()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                fn()
                end.record(stream)
            end.synchronize()
            samples[name].append(time.perf_counter() - t0)
    return samples


def _with_policy(mode: str, fn: Callable[[], None]) -> Callable[[], None]:
    def run():
        old = set_copy_policy(mode)
        try:
            fn()
        finally:
            set_copy_policy(**old)
    return run


def scenario(direction: str, block_bytes: int, run: int, stream_kind: str, layers: int = 32,
             rows: int = 256, repeats: int = 15) -> Dict[str, object]:
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = 4 * rows
    elems = block_bytes // 2  # fp16

    def alloc(on_device: bool, fill: bool):
        if on_device:
            make = (lambda: torch.randn(pool, elems, device=dev, dtype=torch.float16)) if fill else \
                (lambda: torch.zeros(pool, elems, device=dev, dtype=torch.float16))
        else:
            make = (lambda: torch.randn(pool, elems, dtype=torch.float16).pin_memory()) if fill else \
                (lambda: torch.zeros(pool, elems, dtype=torch.float16).pin_memory())
        return [make() for _ in range(layers)]

    src_dev, dst_dev = {"h2d": (False, True), "d2h": (True, False), "d2d": (True, True)}[direction]
    src, dst = alloc(src_dev, True), alloc(dst_dev, False)
    mapping = _mapping(pool, rows, run, seed=block_bytes + run)
    nbytes = layers * rows * block_bytes
    n_elems = layers * rows * elems
    flat_src = torch.randn(n_elems, dtype=torch.float16, device=dev if src_dev else "cpu")
    flat_dst = torch.zeros(n_elems, dtype=torch.float16, device=dev if dst_dev else "cpu")
    if not src_dev:
        flat_src = flat_src.pin_memory()
    if not dst_dev:
        flat_dst = flat_dst.pin_memory()
    sp, dp, sizes = _ptrs(src, dst, mapping)

    def ours():
        ops.swap_blocks_batch(src, dst, mapping)

    cases: Dict[str, Callable[[], None]] = {
        "ours[auto]": _with_policy("auto", ours),
        "ours[kernel]": _with_policy("kernel", ours),
        "ours[dma]": _with_policy("dma", ours),
        "contiguous": lambda: flat_dst.copy_(flat_src, non_blocking=True),
        "memcpy_loop": lambda: _C._bench_memcpy_loop(sp, dp, sizes),
    }
    if stream_kind == "side" and hasattr(_C, "_bench_memcpy_batch"):
        cases["memcpy_batch"] = lambda: _C._bench_memcpy_batch(sp, dp, sizes)
    if direction == "d2d":
        s_idx, d_idx = mapping[:, 0].to(dev), mapping[:, 1].to(dev)
        cases["index_copy"] = lambda: [d.index_copy_(0, d_idx, s.index_select(0, s_idx))
                                       for s, d in zip(src, dst)]
    stream = torch.cuda.default_stream(dev) if stream_kind == "default" else torch.cuda.Stream(dev)
    samples = _time_cases(cases, stream, repeats)

    # Only worth reading if the copy is right.
    for d in dst:
        d.zero_()
    with torch.cuda.stream(stream):
        ours()
    torch.cuda.synchronize()
    for s, d in zip(src, dst):
        assert torch.equal(d[mapping[:, 1].to(d.device)].cpu(), s[mapping[:, 0].to(s.device)].cpu())

    med = {k: statistics.median(v) for k, v in samples.items()}
    iqr = {k: (statistics.quantiles(v, n=4)[0], statistics.quantiles(v, n=4)[2]) for k, v in samples.items()}
    alternatives = {k: v for k, v in med.items() if not k.startswith("ours") and k != "contiguous"}
    best_alt = min(alternatives, key=alternatives.get)
    ours_t = med["ours[auto]"]
    return {
        "scenario": f"{direction} {block_bytes // KIB}KiB" + (f" runs of {run}" if run > 1 else ""),
        "stream": stream_kind, "layers": layers, "blocks_per_layer": rows, "bytes": nbytes,
        "seconds": med, "iqr_seconds": iqr,
        "gbps": {k: gbps(nbytes, v) for k, v in med.items()},
        "ours_vs_limit": med["contiguous"] / ours_t,
        "strongest_alternative": best_alt,
        "ours_vs_strongest_alternative": med[best_alt] / ours_t,
        "policy": get_copy_policy(),
    }


def run(quick: bool = False) -> List[Dict[str, object]]:
    if not torch.cuda.is_available():
        return []
    repeats = 7 if quick else 15
    out = []
    for direction in ("h2d", "d2h", "d2d"):
        for block_kib, run_len in ((2, 1), (16, 1), (32, 1), (16, 16)):
            rows = 1024 if block_kib == 2 else 256
            for stream_kind in ("default", "side"):
                out.append(scenario(direction, block_kib * KIB, run_len, stream_kind, rows=rows,
                                    repeats=repeats))
    return out


def print_table(results: List[Dict[str, object]]) -> None:
    for r in results:
        print(f"\n{r['scenario']} ({r['stream']} stream, {r['layers']} layers x "
              f"{r['blocks_per_layer']} blocks, {r['bytes'] / 2**20:.0f} MiB): ours[auto] = "
              f"{r['ours_vs_limit']:.2f}x the limit, {r['ours_vs_strongest_alternative']:.2f}x "
              f"{r['strongest_alternative']}")
        for case, sec in r["seconds"].items():
            lo, hi = r["iqr_seconds"][case]
            print(f"  {case:14} {sec * 1e3:9.3f} ms  (IQR {lo * 1e3:.3f}-{hi * 1e3:.3f})  "
                  f"{r['gbps'][case]:8.1f} GB/s")
