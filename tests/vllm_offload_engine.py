"""Engine side of tests/test_vllm_offload.py (run as a script; prints one JSON line).

In one process, one after the other (the second engine starts in ~2 s once vLLM is
imported), on the context-sensitive test Llama with a KV cache of a few blocks:

1. ``offload``: an engine with OffloadingConnector + KvopsOffloadingSpec serves prompt
   X, then filler prompts that evict X's blocks from its KV cache, then X again: its
   prefix must come back from the host tier. vLLM's metrics are read after this phase.
2. ``corrupted``: the same engine, with a fault installed *by this test script* on the
   worker (every load is followed by zeroing the engine blocks it filled), evicts X
   again with other fillers and serves it once more: the tokens must change.
3. ``control``: an engine without a connector runs the sequence of phase 1.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core and worker in this process
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}
MODEL = dict(layers=4, hidden=256, heads=4, kv_heads=2, vocab=1024, max_len=1024)
BLOCK_SIZE = 32
ENGINE_BLOCKS = 24  # 23 usable: X (7 blocks) is gone after three 13-block fillers
PROMPT_LEN, FILLER_LEN, FILLERS, NEW_TOKENS = 200, 400, 3, 8
OFFLOAD_EXTRA = {"spec_name": "KvopsOffloadingSpec",
                 "spec_module_path": "torch_kvops.integrations.vllm.offload",
                 "cpu_bytes_to_use": 64 << 20}
METRICS = ("vllm:kv_offload_load_bytes", "vllm:kv_offload_store_bytes",
           "vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits")


def make_llm(model_dir: str, with_offload: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = (KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                           kv_connector_extra_config=OFFLOAD_EXTRA) if with_offload else None)
    return LLM(model=model_dir, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
               block_size=BLOCK_SIZE, num_gpu_blocks_override=ENGINE_BLOCKS, max_model_len=512,
               max_num_batched_tokens=512, kv_transfer_config=kv, disable_log_stats=False, seed=0)


def serve(llm, prompt):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return {"tokens": list(out.outputs[0].token_ids), "cached_tokens": out.num_cached_tokens}


def serve_evict_serve(llm, prompt, fillers):
    first = serve(llm, prompt)
    for filler in fillers:
        serve(llm, filler)
    return {"first": first, "again": serve(llm, prompt)}


def metrics(llm):
    totals = {name: 0 for name in METRICS}
    for m in llm.get_metrics():
        if m.name in totals:
            totals[m.name] += int(m.value)
    return totals


def zero_loaded_blocks(worker):
    """The fault of phase 2: after every load, overwrite the engine blocks it filled."""
    real_submit_load = worker.submit_load

    def corrupted_load(job_id, src_spec, dst_spec):
        ok = real_submit_load(job_id, src_spec, dst_spec)
        worker.wait({job_id})
        for engine_tensor in worker.tier.engine:
            engine_tensor[dst_spec.block_ids.tolist()] = 0
        return ok

    worker.submit_load = corrupted_load


def main() -> None:
    os.environ.update(ENGINE_ENV)
    from torch_kvops.testing.hf_model import write_context_model

    rng = random.Random(14)
    prompt = [rng.randrange(3, MODEL["vocab"]) for _ in range(PROMPT_LEN)]

    def fillers():
        return [[rng.randrange(3, MODEL["vocab"]) for _ in range(FILLER_LEN)] for _ in range(FILLERS)]

    fillers_a, fillers_b = fillers(), fillers()
    result = {}
    with tempfile.TemporaryDirectory() as model_dir:
        write_context_model(model_dir, seed=0, **MODEL)
        t0 = time.monotonic()
        llm = make_llm(model_dir, with_offload=True)
        result["start_s"] = time.monotonic() - t0
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().connector_worker.worker
        result["worker"] = type(worker).__name__
        result["offload"] = serve_evict_serve(llm, prompt, fillers_a)
        result["offload"]["metrics"] = metrics(llm)
        zero_loaded_blocks(worker)
        for filler in fillers_b:
            serve(llm, filler)
        result["corrupted"] = serve(llm, prompt)
        llm.llm_engine.engine_core.shutdown()  # closes the connector: drains, frees the tier
        del llm, worker

        llm = make_llm(model_dir, with_offload=False)
        result["control"] = serve_evict_serve(llm, prompt, fillers_a)
        llm.llm_engine.engine_core.shutdown()
        result["total_s"] = time.monotonic() - t0
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
