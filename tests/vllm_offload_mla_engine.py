"""Engine side of tests/test_vllm_offload_mla.py (run as a script; prints one JSON line).

KvopsOffloadingSpec with an MLA model at tensor parallelism 2 (vLLM's mp executor):
every rank's latent cache is the same, so vLLM's offloading config asks for one host
copy per block (``replicated_layout``). The MLA test model runs on vLLM's AMX_MLA
backend (bf16, block size 32): the CPU_MLA backend turns prefix caching off, and
without prefix caching nothing is offloaded or looked up. This needs a CPU with AMX;
without one the script fails and says so.

1. ``offload``: prompt X, fillers that evict X's blocks from the engine's KV cache,
   X again: its prefix comes back from the host tier (both ranks load it).
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
LAYERS, BLOCK_SIZE, ENGINE_BLOCKS = 2, 32, 24
PROMPT_LEN, FILLER_LEN, FILLERS, NEW_TOKENS = 200, 400, 3, 6
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


def main() -> None:
    os.environ.update(ENGINE_ENV)
    import torch

    if not torch.cpu._is_amx_tile_supported():
        raise SystemExit("this test needs a CPU with AMX (vLLM's AMX_MLA backend keeps prefix caching "
                         "for MLA; CPU_MLA turns it off, and with it KV offloading)")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from torch_kvops.testing.mla_model import write_mla_model

    rng = random.Random(21)
    vocab = 1024
    prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]

    def fillers():
        return [[rng.randrange(3, vocab) for _ in range(FILLER_LEN)] for _ in range(FILLERS)]

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)

    def serve(p):
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        return {"tokens": list(out.outputs[0].token_ids), "cached_tokens": out.num_cached_tokens}

    def serve_evict_serve(fill):
        first = serve(prompt)
        for f in fill:
            serve(f)
        return {"first": first, "again": serve(prompt)}

    result = {}
    with tempfile.TemporaryDirectory() as model_dir:
        write_mla_model(model_dir, layers=LAYERS)
        t0 = time.monotonic()
        llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                  block_size=BLOCK_SIZE, num_gpu_blocks_override=ENGINE_BLOCKS, max_model_len=512,
                  max_num_batched_tokens=512, seed=0, tensor_parallel_size=2,
                  distributed_executor_backend="mp", attention_config={"backend": "AMX_MLA"},
                  kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                      kv_connector_extra_config=OFFLOAD_EXTRA))
        result["start_s"] = time.monotonic() - t0
        result["offload"] = serve_evict_serve(fillers())
        result["ranks"] = llm.collective_rpc(rank_report)
        llm.collective_rpc(zero_host_tier_on_rank_1)
        result["ranks_after_zeroing"] = llm.collective_rpc(rank_report)
        for f in fillers():
            serve(f)
        result["corrupted"] = serve(prompt)
        llm.llm_engine.engine_core.shutdown()
        result["total_s"] = time.monotonic() - t0
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
