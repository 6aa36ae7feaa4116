"""Engine side of tests/test_vllm_offload_mla.py (run as a script; prints one JSON line).

KvopsOffloadingSpec with an MLA model at tensor parallelism 2 (vLLM's mp executor):
every rank's latent cache is the same, so vLLM's offloading config asks for one host
copy per block (``replicated_layout``). ``python vllm_offload_mla_engine.py BACKEND``
with BACKEND one of:

- ``CPU_MLA`` (runs on any x86-64 CPU vLLM supports, block size 16): vLLM's CPU
  platform turns prefix caching off for MLA unless AMX_MLA is in use, and without
  prefix caching nothing is offloaded or looked up. :func:`keep_prefix_caching` puts
  back the value the engine was given, as a test-only plugin would. The reason vLLM
  turns it off is CPU_MLA's prefill over cached context; here every request with a
  cached prefix computes exactly one token, which vLLM runs on the decode path (the
  paged decode kernel over the cached latent), so that path is never taken.
- ``AMX_MLA`` (needs a CPU with AMX tiles, block size 32): prefix caching stays on
  by itself.

1. ``offload``: ``head`` (whole blocks) is served once; then ``head + [t]`` (its prefix
   from the engine's own cache, ``t`` on the decode path): the reference; fillers evict
   ``head``'s blocks from the engine's KV cache; ``head + [t]`` again: its prefix comes
   back from the host tier (both ranks load it) and ``t`` runs on the same decode path,
   so any difference in the tokens comes from the bytes loaded.
2. Per rank: the spec's layout decision, the jobs each rank submitted (rank 1 never
   stores), and a digest of each rank's view of the host tier (equal: rank 1 reads
   the bytes rank 0 wrote, through one shared region).
3. ``corrupted``: rank 1 zeroes its view of the host tier; rank 0's view must read
   zeros too (one copy), and X served again after eviction answers differently.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core here: collective_rpc takes functions
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}
BACKENDS = {"CPU_MLA": 16, "AMX_MLA": 32}  # backend -> the block size it takes
LAYERS, ENGINE_TOKENS = 2, 768  # the engine's KV cache: 48 blocks of 16, 24 of 32
HEAD_BLOCKS, FILLER_LEN, FILLERS, NEW_TOKENS = 6, 400, 3, 6
OFFLOAD_EXTRA = {"spec_name": "KvopsOffloadingSpec",
                 "spec_module_path": "torch_kvops.integrations.vllm.offload",
                 "num_cpu_blocks": 128}


def rank_report(worker) -> dict:
    """Runs in each rank: its spec's layout decision, jobs, and host-tier digest."""
    import hashlib

    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    connector = get_kv_transfer_group().connector_worker
    kvops = connector.worker
    digest = hashlib.sha256()
    for host in kvops.tier.host:
        digest.update(host.contiguous().numpy().tobytes())
    return {"rank": get_tensor_model_parallel_rank(), "replicated_layout": connector.spec.replicated_layout,
            "num_chunks": connector.spec.num_chunks, "kv_bytes_per_chunk": connector.spec.kv_bytes_per_chunk,
            "worker_kv_bytes_per_block": connector.spec.config.worker_kv_bytes_per_block,
            "host_bytes_seen": sum(h.numel() for h in kvops.tier.host),
            "jobs": dict(kvops.jobs_submitted), "digest": digest.hexdigest()}


def zero_host_tier_on_rank_1(worker) -> bool:
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != 1:
        return False
    for host in get_kv_transfer_group().connector_worker.worker.tier.host:
        host.zero_()
    return True


def keep_prefix_caching() -> None:
    """Test-only: keep ``enable_prefix_caching`` as the engine was configured after vLLM's
    CPU platform has checked the config (it turns it off for MLA without AMX). The
    config is built in this process (V1 multiprocessing off) and handed to the workers
    as it is, so patching the platform here is enough."""
    from vllm.platforms.cpu import CpuPlatform

    checked = CpuPlatform.check_and_update_config.__func__

    def check_and_keep(cls, vllm_config) -> None:
        wanted = vllm_config.cache_config.enable_prefix_caching
        checked(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = wanted

    CpuPlatform.check_and_update_config = classmethod(check_and_keep)


def main(backend: str) -> None:
    os.environ.update(ENGINE_ENV)
    import torch

    if backend == "AMX_MLA" and not torch.cpu._is_amx_tile_supported():
        raise SystemExit("AMX_MLA needs a CPU with AMX tiles (lscpu flag amx_tile)")
    if backend == "CPU_MLA":
        keep_prefix_caching()
    block_size = BACKENDS[backend]
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from torch_kvops.testing.mla_model import write_mla_model

    rng = random.Random(21)
    vocab = 1024
    head = [rng.randrange(3, vocab) for _ in range(HEAD_BLOCKS * block_size)]
    prompt = head + [rng.randrange(3, vocab)]

    def fillers():
        return [[rng.randrange(3, vocab) for _ in range(FILLER_LEN)] for _ in range(FILLERS)]

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)

    def serve(p):
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids), "cached_tokens": out.num_cached_tokens}

    def serve_evict_serve(fill):
        warm = serve(head)
        first = serve(prompt)
        for f in fill:
            serve(f)
        return {"warm": warm, "first": first, "again": serve(prompt)}

    result = {}
    with tempfile.TemporaryDirectory() as model_dir:
        write_mla_model(model_dir, layers=LAYERS)
        t0 = time.monotonic()
        llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                  block_size=block_size, num_gpu_blocks_override=ENGINE_TOKENS // block_size,
                  max_model_len=512, max_num_batched_tokens=512, seed=0, tensor_parallel_size=2,
                  enable_prefix_caching=True, distributed_executor_backend="mp",
                  attention_config={"backend": backend},
                  kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                      kv_connector_extra_config=OFFLOAD_EXTRA))
        result["start_s"] = time.monotonic() - t0
        result["prefix_caching"] = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        result["offload"] = serve_evict_serve(fillers())
        result["ranks"] = llm.collective_rpc(rank_report)
        llm.collective_rpc(zero_host_tier_on_rank_1)
        result["ranks_after_zeroing"] = llm.collective_rpc(rank_report)
        for f in fillers():
            serve(f)
        result["corrupted"] = serve(prompt)
        result["block_size"] = block_size
        llm.llm_engine.engine_core.shutdown()
        result["total_s"] = time.monotonic() - t0
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
