"""Timing helpers shared by the benchmarks: interleaved medians, machine label."""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch


def machine() -> Dict[str, object]:
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # Linux names the model; elsewhere keep platform's
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    info: Dict[str, object] = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
                               "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def interleaved_samples(cases: Dict[str, Callable[[], None]], repeats: int,
                        warmup: int = 1, sync: Callable[[], None] = lambda: None) -> Dict[str, List[float]]:
    """Run every case once per round, ``repeats`` rounds, and return each case's
    seconds per round. Interleaving spreads machine noise over all cases alike."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
        sync()
    samples: Dict[str, List[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return samples


def interleaved_medians(cases: Dict[str, Callable[[], None]], repeats: int,
                        warmup: int = 1, sync: Callable[[], None] = lambda: None) -> Dict[str, float]:
    """:func:`interleaved_samples`, reduced to each case's median seconds."""
    samples = interleaved_samples(cases, repeats, warmup, sync)
    return {name: statistics.median(v) for name, v in samples.items()}


def median_iqr(samples: List[float]) -> Tuple[float, float, float]:
    """(median, first quartile, third quartile) of at least one sample."""
    if len(samples) < 2:
        return samples[0], samples[0], samples[0]
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q1, q3


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
