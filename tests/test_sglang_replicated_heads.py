"""SGLang P/D of a model with fewer KV heads than attention TP ranks, moved by KV head
(``"mha_unit": "head"``): real SGLang 0.5.23 servers behind sglang-router, against a
monolithic server with the same TP. The test Llama here has one KV head, so every rank
of a TP 2 server holds a replica of it.

SGLang tells a decode rank's destination to some prefill ranks only (its rank mapping:
the same rank between equal sizes; every prefill rank of the decode rank's heads when
the prefill server has more ranks). Of those, the lowest holding a head sends it
(integrations/sglang/heads.py, ``destination_ranks``); the others end the room without
a transfer. Between P at TP 2 and D at TP 2, each prefill rank sends its own decode
rank the head (a replica on rank 0 could not: SGLang never tells it rank 1's pages);
between P at TP 2 and D1 at TP 1, rank 0 sends and rank 1 sends nothing.

Stand-ins as tests/test_sglang_tp.py: the two CPU kernels of sgl_kernel, PyNccl off for
SGLang's CPU groups; each rank of a TP 2 server bound to one core.
"""
from __future__ import annotations

import pytest

from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec

from serving_fleet import workspace
from sglang_fleet import (PAGE_SIZE, ROUTER_CHECKS, add_tp2_servers, count, differ_from_reference, fleet_env,
                          pages_come_back, rooms_of_a_load, router_ready, sabotage_changes_the_answers,
                          serving)

pytestmark = [pytest.mark.fleet, pytest.mark.sglang]

CHUNK = 256  # P's --chunked-prefill-size; prompts are 50-800 tokens
N = 8


@pytest.fixture(scope="module")
def fleet():
    with workspace("kvops-sglang-replicas", kv_heads=1) as (tmp, model, log_dir, sabotage):
        env = fleet_env(tmp, "cpu_tp_groups", mha_unit="head")
        with Servers(log_dir) as servers:
            p, _ = add_tp2_servers(servers, model, env, CHUNK)
            # started by its test only: a decode server with TP 1 behind a router of its own
            d1 = servers.add(SglangServerSpec("D1", model, role="decode", env=env, page_size=PAGE_SIZE))
            servers.add(SglangRouterSpec("tp1", [p], [d1], extra_args=ROUTER_CHECKS))
            with serving(servers, ["P", "D", "ref"]):
                yield servers, model, sabotage


def _load_equals_the_reference(fleet, seed: int, router: str, decode: str, decode_ranks: int) -> None:
    """N prompts at once through ``router``: the reference's answers; both prefill
    ranks and every rank of ``decode`` ended every room, none failed."""
    servers, model, _ = fleet
    ended = rooms_of_a_load(servers, model, seed, N, router, "P", decode, f"sglang replicas {router}")
    assert ended["P"] >= 2 * N and ended[decode] >= decode_ranks * N, ended
    assert not any(count(servers[n].metrics(), "rooms", label="failed") for n in ("P", decode))
    with open(servers[decode].log_path) as f:
        assert "moved by KV head (1 of 1)" in f.read()


def _dropped_layer_changes_the_answers(fleet, seed: int, router: str) -> None:
    """Negative control: the keys of layer 1 move no byte, D's checks off."""
    servers, model, sabotage = fleet
    tag = f"sglang replicas {router} drop_layer"
    sabotage_changes_the_answers(sabotage, ("drop_layer", "unverified", "unchecked"),
                                 lambda: differ_from_reference(servers, model, seed, N, tag, router=router))


def test_each_prefill_rank_sends_its_replica_to_its_own_decode_rank(fleet):
    _load_equals_the_reference(fleet, 60, "router", "D", decode_ranks=2)
    _dropped_layer_changes_the_answers(fleet, 61, "router")
    pages_come_back(fleet[0], ["P", "D"])


def test_one_replica_sends_a_decode_server_of_tp_1_and_the_other_ends_the_room_without_a_transfer(fleet):
    servers = fleet[0]
    servers.start(["D1"])
    servers.start(["tp1"])
    try:
        router_ready(servers["tp1"])
        _load_equals_the_reference(fleet, 62, "tp1", "D1", decode_ranks=1)
        _dropped_layer_changes_the_answers(fleet, 63, "tp1")
        pages_come_back(servers, ["P", "D1"])
    finally:  # their health checks would load the machine for the rest of the module
        servers["tp1"].stop()
        servers["D1"].stop()
