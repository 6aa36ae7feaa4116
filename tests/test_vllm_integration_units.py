"""Pieces of the vLLM integration that need no engine: cache layouts, the decode ->
prefill side channel (real sockets on loopback), settings."""
import json
import socket
import time

import pytest
import torch

from torch_kvops.integrations.vllm.metadata import KvopsSettings
from torch_kvops.integrations.vllm.side_channel import DestinationPoster, DestinationServer
from torch_kvops.integrations.vllm.worker import block_views


def test_block_views_accept_block_major_and_kv_plane_layouts():
    cpu = torch.zeros(10, 4, 32, 128)  # vLLM CPU backend: [blocks, kv_heads, block, 2*head]
    assert [v.shape for v in block_views("l0", cpu, 10)] == [cpu.shape]
    planes = torch.zeros(2, 10, 32, 4, 64)  # [K/V, blocks, ...]
    k, v = block_views("l0", planes, 10)
    assert k.shape == (10, 32, 4, 64) and v.data_ptr() == planes[1].data_ptr()


@pytest.mark.parametrize("cache", [torch.zeros(4, 10, 8),  # blocks not on dim 0 or 1
                                   torch.zeros(8, 10, 4).permute(1, 0, 2)])  # strided blocks
def test_block_views_reject_other_layouts_clearly(cache):
    with pytest.raises(ValueError, match="unsupported layout"):
        block_views("model.layers.0.attn", cache, 10)


def test_destination_posted_by_decode_is_taken_once_by_prefill():
    server = DestinationServer("127.0.0.1", 0)
    poster = DestinationPoster(timeout_s=1.0, retries=0)
    try:
        poster.post(server.address, {"transfer_id": "t1", "block_ids": [4, 5], "start_token": 0,
                                     "peer": {"engine_id": "d"}})
        deadline = time.monotonic() + 5
        dest = None
        while dest is None and time.monotonic() < deadline:
            dest = server.take("t1")
            time.sleep(0.01)
        assert dest == {"block_ids": [4, 5], "start_token": 0, "peer": {"engine_id": "d"}}
        assert server.take("t1") is None
        assert poster.failures == 0
    finally:
        poster.close()
        server.close()


def _ask(address, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        sock.settimeout(2)
        sock.sendall(payload)
        return sock.recv(64).strip()


def test_side_channel_is_bounded_and_refuses_malformed_messages():
    server = DestinationServer("127.0.0.1", 0, capacity=2)
    try:
        msg = {"block_ids": [1], "start_token": 0, "peer": {}}
        assert _ask(server.address, b"not json\n") == b"bad"
        assert _ask(server.address, json.dumps({"transfer_id": "x"}).encode() + b"\n") == b"bad"
        for tid, answer in [("a", b"ok"), ("b", b"ok"), ("c", b"full")]:
            assert _ask(server.address, json.dumps(dict(msg, transfer_id=tid)).encode() + b"\n") == answer
        assert server.take("c") is None and server.take("a") is not None
    finally:
        server.close()


def test_posting_to_a_dead_prefill_side_gives_up_within_its_bound():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    poster = DestinationPoster(timeout_s=0.5, retries=2)
    try:
        start = time.monotonic()
        poster.post(f"127.0.0.1:{port}", {"transfer_id": "t"})
        while poster.failures == 0 and time.monotonic() - start < 10:
            time.sleep(0.01)
        assert poster.failures == 1
        assert time.monotonic() - start < 3 * 0.5 + 1.0
    finally:
        poster.close()


def test_settings_reject_unknown_keys_and_modes():
    assert KvopsSettings.from_extra({"push_mode": "after_forward"}).push_mode == "after_forward"
    with pytest.raises(ValueError, match="unknown"):
        KvopsSettings.from_extra({"pushmode": "layerwise"})
    with pytest.raises(ValueError, match="push_mode"):
        KvopsSettings.from_extra({"push_mode": "eventually"})
    with pytest.raises(TypeError):
        KvopsSettings.from_extra({"connector": {"no_such_field": 1}})
