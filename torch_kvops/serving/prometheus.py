"""Read a server's Prometheus ``/metrics`` (text exposition format).

vLLM's API server exports its own gauges and counters (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``: the used fraction of the
block pool, ...) and those of the KV connector (``vllm:kvops_*``,
torch_kvops/integrations/vllm/metrics.py), each labelled with ``model_name`` and
``engine``.
"""
from __future__ import annotations

import re
import urllib.request
from typing import Dict, Iterable, Tuple

Labels = Tuple[Tuple[str, str], ...]
Samples = Dict[Tuple[str, Labels], float]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> Samples:
    """Samples of a text exposition: {(name, sorted label pairs): value}."""
    out: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, labels, value = m.groups()
        try:
            number = float(value)  # also NaN, +Inf, -Inf
        except ValueError:
            raise ValueError(f"not a Prometheus sample line (value {value!r}): {line!r}") from None
        out[(name, tuple(sorted(_LABEL.findall(labels or ""))))] = number
    return out


def fetch(base_url: str, timeout: float = 10.0) -> Samples:
    """GET ``base_url``/metrics and parse it."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as resp:
        return parse(resp.read().decode())


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 if none)."""
    want = set(labels.items())
    return sum(v for (n, pairs), v in samples.items() if n == name and want <= set(pairs))


def prompt_tokens(samples: Samples, source: str) -> float:
    """An engine's prompt tokens so far by ``source``: ``local_compute`` (it computed
    them) or ``external_kv_transfer`` (their KV came from another engine)."""
    return total(samples, "vllm:prompt_tokens_by_source_total", source=source)


def find(samples: Samples, prefix: str) -> Dict[str, float]:
    """Samples whose name starts with ``prefix``, as ``name{k=v,...}`` -> value (without
    the model_name and engine labels), summed over what those labels told apart."""
    out: Dict[str, float] = {}
    for (n, pairs), v in samples.items():
        if n.startswith(prefix):
            extra = ",".join(f"{k}={val}" for k, val in pairs if k not in ("model_name", "engine"))
            key = n + (f"{{{extra}}}" if extra else "")
            out[key] = out.get(key, 0.0) + v
    return out


def engine_state(samples: Samples) -> Dict[str, float]:
    """The gauges that say whether an engine is idle with its block pool free."""
    return {"running": total(samples, "vllm:num_requests_running"),
            "waiting": total(samples, "vllm:num_requests_waiting"),
            "kv_cache_usage": total(samples, "vllm:kv_cache_usage_perc")}


def is_idle(samples: Samples) -> bool:
    """No request running or waiting and no block of the pool in use."""
    state = engine_state(samples)
    return state["running"] == 0 and state["waiting"] == 0 and state["kv_cache_usage"] == 0


def names(samples: Iterable[Tuple[str, Labels]]) -> set:
    """The metric names present."""
    return {n for n, _ in samples}


__all__ = ["parse", "fetch", "total", "find", "engine_state", "is_idle", "names", "Samples"]
