"""swap_blocks_batch against the copies people write by hand, on the same bytes.

Scenarios (from the op library issue):
- bandwidth-bound: 32 layers x 256 fragmented 16 KiB blocks, vs one contiguous
  ``copy_`` of the same number of bytes (the physical proxy) and vs per-layer
  ``index_copy_``;
- descriptor-bound: 32 layers x 4096 blocks of 512 bytes, vs per-layer
  ``index_copy_`` and a per-block ``copy_`` loop;
GPU scenarios live in ``cuda_copy.py`` (C++ baselines, not a Python loop).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .. import ops
from .common import gbps, interleaved_medians


def _fragmented_mapping(num_blocks: int, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randperm(num_blocks, generator=gen)[:rows]
    dst = torch.randperm(num_blocks, generator=gen)[:rows]
    return torch.stack([src, dst], dim=1)


def _scenario(name: str, layers: int, pool_blocks: int, rows: int, block_elems: int,
              repeats: int, src_device: str = "cpu", dst_device: str = "cpu",
              per_block_loop: bool = False) -> Dict[str, object]:
    pin = src_device == "cuda" or dst_device == "cuda"
    def alloc(device: str) -> List[torch.Tensor]:
        return [torch.randn(pool_blocks, block_elems, device=device,
                            pin_memory=(pin and device == "cpu")) for _ in range(layers)]

    src, dst = alloc(src_device), alloc(dst_device)
    mapping = _fragmented_mapping(pool_blocks, rows, seed=0)
    s_idx = mapping[:, 0].to(src_device)
    d_idx = mapping[:, 1].to(dst_device)
    nbytes = layers * rows * block_elems * 4
    # Filled, not torch.empty: untouched pages all map the kernel's zero page, which
    # a copy reads from cache at a bandwidth no real KV cache has.
    flat_src = torch.randn(layers * rows * block_elems).to(src_device)
    flat_dst = torch.randn(layers * rows * block_elems).to(dst_device)
    if pin:
        flat_src = flat_src.pin_memory() if src_device == "cpu" else flat_src
        flat_dst = flat_dst.pin_memory() if dst_device == "cpu" else flat_dst
    pairs = mapping.tolist()

    cases = {
        "swap_blocks_batch": lambda: ops.swap_blocks_batch(src, dst, mapping),
        "contiguous_copy": lambda: flat_dst.copy_(flat_src, non_blocking=True),
        "index_copy_per_layer": lambda: [d.index_copy_(0, d_idx, s.index_select(0, s_idx).to(d.device, non_blocking=True))
                                         for s, d in zip(src, dst)],
    }
    if per_block_loop:
        def loop():
            for s, d in zip(src, dst):
                for a, b in pairs:
                    d[b].copy_(s[a], non_blocking=True)
        cases["per_block_copy_loop"] = loop

    sync = torch.cuda.synchronize if "cuda" in (src_device, dst_device) else (lambda: None)
    medians = interleaved_medians(cases, repeats, sync=sync)
    ops.swap_blocks_batch(src, dst, mapping)
    sync()
    for s, d in zip(src, dst):  # the benchmark is only worth reading if the copy is right
        assert torch.equal(d[mapping[:, 1].to(d.device)].cpu(), s[mapping[:, 0].to(s.device)].cpu())
    ours = medians["swap_blocks_batch"]
    return {
        "scenario": name, "layers": layers, "blocks_per_layer": rows,
        "block_bytes": block_elems * 4, "bytes": nbytes, "src": src_device, "dst": dst_device,
        "seconds": medians,
        "gbps": {k: gbps(nbytes, v) for k, v in medians.items()},
        "speedup_vs": {k: v / ours for k, v in medians.items() if k != "swap_blocks_batch"},
    }


def run(quick: bool = False) -> List[Dict[str, object]]:
    repeats = 5 if quick else 15
    results = [
        _scenario("fragmented_16KiB", layers=32, pool_blocks=512, rows=256, block_elems=4096,
                  repeats=repeats),
        _scenario("descriptor_bound_512B", layers=32, pool_blocks=8192, rows=4096, block_elems=128,
                  repeats=max(3, repeats // 3), per_block_loop=True),
    ]
    return results


def print_table(results: List[Dict[str, object]]) -> None:
    print(f"{'scenario':28} {'case':24} {'ms':>9} {'GB/s':>8} {'ours is x faster':>17}")
    for r in results:
        for case, sec in r["seconds"].items():
            ratio = r["speedup_vs"].get(case)
            print(f"{r['scenario']:28} {case:24} {sec * 1e3:9.2f} {r['gbps'][case]:8.2f} "
                  f"{'' if ratio is None else f'{ratio:17.2f}'}")
