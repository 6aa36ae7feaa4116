"""``python -m torch_kvops.testing.paged_llama [--layers N --hidden H --lengths ...]``:
time one-shot prefill of a PagedLlama of that shape."""
from __future__ import annotations

import argparse
import time

import torch

from .batch import blocks_needed
from .config import LlamaConfig, bench_config
from .generation import prefill
from .model import PagedLlama


def _time_prefill(cfg: LlamaConfig, lengths=(1024, 2048, 4096), repeats: int = 2) -> None:
    model = PagedLlama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{cfg}\nparams: {n_params / 1e6:.1f}M, threads: {torch.get_num_threads()}")
    for n in lengths:
        caches = model.allocate_kv_caches(blocks_needed(n, cfg.block_size))
        prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        best = float("inf")
        for _ in range(repeats):
            bt = [list(range(blocks_needed(n, cfg.block_size)))]
            t0 = time.perf_counter()
            prefill(model, [prompt], caches, bt)
            best = min(best, time.perf_counter() - t0)
        print(f"prefill {n:5d} tokens: {best:.3f} s")


def main() -> None:
    """Parse the command line and print the timings."""
    ap = argparse.ArgumentParser(prog="python -m torch_kvops.testing.paged_llama",
                                 description="time one-shot prefill of PagedLlama")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    a = ap.parse_args()
    _time_prefill(bench_config(a.layers, a.hidden), a.lengths)


if __name__ == "__main__":
    main()
