"""Read-only probes of a running engine's workers, for tests, examples and debugging:
each takes the vLLM worker first, so ``engine.collective_rpc(probe, args=...)`` runs it
on every tensor-parallel rank (in the engine process or its worker processes)."""
from __future__ import annotations

import re
from typing import Dict, List, Optional

import numpy as np


def _connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def worker_stats(worker) -> dict:
    """This rank's KvopsLayerwiseConnector counters ({} without one)."""
    connector = _connector()
    return connector.stats() if hasattr(connector, "stats") else {}


def worker_pid(worker) -> int:
    """This rank's process id (a test kills one rank)."""
    import os

    return os.getpid()


def worker_steps(worker, transfer_id: Optional[str] = None) -> list:
    """This rank's recent push steps (prefill side; [] elsewhere)."""
    connector = _connector()
    return connector.recent_steps(transfer_id) if hasattr(connector, "recent_steps") else []


def worker_kv(worker, block_ids: List[int], num_tokens: int) -> dict:
    """This rank's KV of the first ``num_tokens`` tokens held in ``block_ids``: per layer,
    per block, an array ``[local KV heads, values]``, and the global heads it holds.

    A partial last block is cut along its token axes as vLLM 0.32's CPU backend lays a
    block out (checked against its bytes): per KV head, K as [head, block_size] (token
    axis last), then V as [block_size, head]. An MLA (latent) cache,
    ``[num_blocks, block_size, latent]``, is cut along its token axis and returned as
    one replica (``"latent": True``). Other layouts are returned whole."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    from ...heads import rank_heads

    config = worker.vllm_config
    latent = config.model_config.use_mla
    heads = rank_heads(1 if latent else config.model_config.get_total_num_kv_heads(),
                       config.parallel_config.tensor_parallel_size, get_tensor_model_parallel_rank())
    block_size = config.cache_config.block_size
    caches = {}
    for name, module in config.compilation_config.static_forward_context.items():
        cache = getattr(module, "kv_cache", None)
        if isinstance(cache, (list, tuple)):  # one per virtual engine in older vLLMs
            cache = cache[0] if cache else None
        if cache is not None and cache.numel():
            caches[name] = cache
    layers = []
    for name in sorted(caches, key=lambda n: [int(x) for x in re.findall(r"\d+", n)]):
        cache = caches[name]
        by_head = cache.dim() == 4 and cache.device.type == "cpu" and cache.size(1) == len(heads)
        blocks = []
        for j, block in enumerate(block_ids):
            tokens = min(block_size, num_tokens - j * block_size)
            if tokens <= 0:
                break
            data = cache[block]
            if latent:
                blocks.append(data[:tokens].contiguous().numpy().reshape(1, -1).copy())
                continue
            if not by_head:
                blocks.append(data.contiguous().cpu().numpy().reshape(1, -1).copy())
                continue
            per_head = data.reshape(data.size(0), 2, -1)
            k = per_head[:, 0].reshape(data.size(0), -1, block_size)[:, :, :tokens]
            v = per_head[:, 1].reshape(data.size(0), block_size, -1)[:, :tokens]
            blocks.append(np.concatenate([k.reshape(data.size(0), -1).numpy(),
                                          v.reshape(data.size(0), -1).numpy()], axis=1))
        layers.append(blocks)
    return {"heads": [heads.start, heads.stop], "layers": layers, "latent": latent}


def counter_total(per_rank: List[dict], key: str) -> int:
    """A counter of ``worker_stats`` summed over ranks."""
    return sum(int(stats.get(key, 0)) for stats in per_rank)


def merge_ranks(per_rank: List[dict]) -> List[List[np.ndarray]]:
    """The whole KV from every rank's ``worker_kv``: per layer, per block, all KV heads
    in global order (a replicated head is taken once). MLA: every rank's replica of
    the latent, stacked in rank order (each rank received its own copy)."""
    if per_rank and per_rank[0].get("latent"):
        num_layers = len(per_rank[0]["layers"])
        return [[np.concatenate([rank["layers"][layer][j] for rank in per_rank])
                 for j in range(len(per_rank[0]["layers"][layer]))] for layer in range(num_layers)]
    by_head: Dict[int, List[List[np.ndarray]]] = {}
    for rank in per_rank:
        start, stop = rank["heads"]
        for h in range(start, stop):
            if h not in by_head:
                by_head[h] = [[block[h - start] for block in layer] for layer in rank["layers"]]
    heads = sorted(by_head)
    num_layers = len(by_head[heads[0]])
    return [[np.stack([by_head[h][layer][j] for h in heads]) for j in range(len(by_head[heads[0]][layer]))]
            for layer in range(num_layers)]
