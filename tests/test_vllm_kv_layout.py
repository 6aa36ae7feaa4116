"""The KV cache layout (integrations/vllm/kv_layout.py): the connector asks vLLM for the
head-major layout LBHNC, vLLM's own resolution gives it even to a backend that prefers
another, and a layout taken from vLLM (never guessed from a shape) decides how the
cache moves: head ranges (any TP pairing) for LBHNC, whole blocks in the layout's
physical order at equal TP otherwise, unequal TP refused, and two engines of different
layouts never exchange bytes. The real-engine transfers at TP 2 -> 1 and 1 -> 2 in the
layout vLLM resolves are tests/test_vllm_tp.py's.
"""

import pytest
import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

from torch_kvops.integrations.vllm.kv_layout import HEAD_MAJOR
from torch_kvops.integrations.vllm.metadata import KvopsSettings, PushReq
from torch_kvops.integrations.vllm.worker_producer import ProducerWorker

pytestmark = [pytest.mark.unit, pytest.mark.vllm]

BLOCKS, HEADS, TOKENS, CONTENT = 8, 4, 16, 32
KVOPS = KVTransferConfig(kv_connector="KvopsLayerwiseConnector",
                         kv_connector_module_path="torch_kvops.integrations.vllm", kv_role="kv_producer")


@pytest.mark.parametrize("with_connector", [True, False], ids=["kvops", "control_no_connector"])
def test_vllm_resolves_the_head_major_layout_for_a_backend_that_prefers_another(with_connector, monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    config = VllmConfig(kv_transfer_config=KVOPS if with_connector else None)
    # a backend whose kernels take both, token-major first (FlashAttention-like)
    layout = resolve_kv_cache_layout(config, [["LBNHC", "LBHNC"]])
    assert layout.name == (HEAD_MAJOR if with_connector else "LBNHC")


def _physical_token_major():
    """Logical [blocks, heads, tokens, content] of a cache laid out [blocks, tokens, heads,
    content] (vLLM's LBNHC), each element its own position."""
    physical = torch.arange(BLOCKS * TOKENS * HEADS * CONTENT, dtype=torch.float32)
    return physical.view(BLOCKS, TOKENS, HEADS, CONTENT).permute(0, 2, 1, 3)


def _producer(tp_size=1):
    settings = KvopsSettings.from_extra({"host": "127.0.0.1"})
    return ProducerWorker(settings, BLOCKS, total_kv_heads=HEADS * tp_size, tp_rank=0, tp_size=tp_size)


def test_another_layout_moves_whole_blocks_in_its_physical_order_and_refuses_unequal_tp():
    worker = _producer()
    try:
        worker.register_kv_caches({"model.layers.0.attn": _physical_token_major()}, "LBNHC")
        assert not worker._by_head
        (_, view), = worker._views["model.layers.0.attn"]
        assert view.shape == (BLOCKS, TOKENS, HEADS, CONTENT) and view.is_contiguous()
    finally:
        worker.close()
    worker = _producer(tp_size=2)
    try:
        with pytest.raises(ValueError, match="LBNHC.*LBHNC"):
            worker.register_kv_caches({"model.layers.0.attn": _physical_token_major()}, "LBNHC")
    finally:
        worker.close()


def test_a_cache_that_is_not_laid_out_as_vllm_says_is_refused_and_head_major_moves_heads():
    worker = _producer(tp_size=2)
    try:
        with pytest.raises(ValueError, match="not laid out as vLLM's layout LBHNC"):
            worker.register_kv_caches({"model.layers.0.attn": _physical_token_major()}, HEAD_MAJOR)
        head_major = torch.zeros(BLOCKS, HEADS, TOKENS, CONTENT)
        worker.register_kv_caches({"model.layers.0.attn": head_major}, HEAD_MAJOR)
        assert worker._by_head
    finally:
        worker.close()


def test_a_decode_engine_of_another_layout_fails_that_request_alone():
    worker = _producer()
    try:
        worker.register_kv_caches({"model.layers.0.attn": torch.zeros(BLOCKS, HEADS, TOKENS, CONTENT)},
                                  HEAD_MAJOR)
        push = PushReq("r", "t", [{"engine_id": "e", "kv_cache_layout": "LBNHC", "by_head": False}],
                       [0], [1], True, "layerwise")
        with pytest.raises(ValueError, match="one layout"):
            worker._plan(push)
    finally:
        worker.close()

