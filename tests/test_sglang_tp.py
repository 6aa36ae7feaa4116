"""SGLang P/D with tensor parallelism and the ``kvops`` backend: real SGLang 0.5.23
servers with ``--tp-size 2`` on both sides behind sglang-router (P/D mode), against a
monolithic SGLang server with the same TP (its reductions in the same order).

Each prefill rank holds its share of the KV heads and pushes them to the decode ranks
SGLang's rank mapping names (equal attention TP: the same rank), over its own connector
and Mooncake engine; a decode server of TP 1 takes one head from each prefill rank
(``"mha_unit": "head"`` on every server: integrations/sglang/heads.py). MHA by page
(the default) between unequal sizes is refused: tests/test_sglang_units.py.

Stand-ins (test-only, labelled in tests/sglang_standin): the two CPU kernels of
sgl_kernel, and PyNccl turned off for SGLang's CPU groups (SGLang 0.5.23 asks a CPU
server for it); each rank is bound to one core (``SGLANG_CPU_OMP_THREADS_BIND``).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec

from serving_fleet import workspace
from sglang_fleet import (LANDED_IN_FORWARD, PAGE_SIZE, ROUTER_CHECKS, add_tp2_servers, answers, count,
                          differ_from_reference, fleet_env, pages_come_back, random_prompts,
                          router_ready, router_serves_again, rooms_of_a_load,
                          sabotage_changes_the_answers, serving)

pytestmark = [pytest.mark.fleet, pytest.mark.sglang]

CHUNK = 256  # P's --chunked-prefill-size; prompts are 50-800 tokens


@pytest.fixture(scope="module")
def fleet():
    with workspace("kvops-sglang-tp") as (tmp, model, log_dir, sabotage):
        env = fleet_env(tmp, "cpu_tp_groups", mha_unit="head")  # P's heads go to D (TP 2) and D1 (TP 1)
        with Servers(log_dir) as servers:
            p, d = add_tp2_servers(servers, model, env, CHUNK)
            # started by its test only: a decode server with TP 1, behind a router of
            # its own with P that tries each request once
            d1 = servers.add(SglangServerSpec("D1", model, role="decode", env=env, page_size=PAGE_SIZE))
            servers.add(SglangRouterSpec("tp1", [p], [d1], extra_args=ROUTER_CHECKS + ["--disable-retries"]))
            # started by its test only: a prefill server with TP 1, behind a router of
            # its own with D
            p1 = servers.add(SglangServerSpec("P1", model, role="prefill", env=env, page_size=PAGE_SIZE,
                                              extra_args=["--chunked-prefill-size", str(CHUNK)]))
            servers.add(SglangRouterSpec("more", [p1], [d], extra_args=ROUTER_CHECKS))
            with serving(servers, ["P", "D", "ref"]):
                yield servers, model, sabotage


def _differ(fleet, seed: int, n: int = 8, router: str = "router"):
    servers, model, _ = fleet
    return differ_from_reference(servers, model, seed, n, f"sglang tp {router}", router=router)


def test_router_answers_equal_the_monolithic_server_with_tp_2_on_both_sides(fleet):
    servers = fleet[0]
    n = 12
    assert _differ(fleet, seed=41, n=n)[0] == []
    p, d = (prometheus.fetch(servers[name].url) for name in ("P", "D"))
    # every room landed on both decode ranks (each rank counts its own share)
    assert count(d, "rooms", label="success") >= 2 * n, count(d, "rooms", label="success")
    assert count(p, "rooms", label="success") >= 2 * n
    assert not any(count(s, "rooms", label="failed") for s in (p, d))
    prefilled = [prometheus.total(s, "sglang:prefill_effective_tokens_total", mode="input") for s in (p, d)]
    assert prefilled[1] == 0 and prefilled[0] > 0, prefilled
    assert count(p, "chunks", label="after_forward") == 0
    layers, early = count(p, "layers"), count(p, "layers_landed_during_forward")
    print(f"\n[sglang tp] {early:.0f} of {layers:.0f} pushed layers landed before their forward ended")
    # most layers land while later ones compute
    assert layers > 0 and early >= layers * LANDED_IN_FORWARD, (early, layers)


def test_negative_control_a_dropped_layer_changes_the_answers(fleet):
    """Every rank's keys of layer 1 move no byte, with D's checks switched off."""
    _, _, sabotage = fleet
    sabotage.set("drop_layer", "unverified", "unchecked")
    try:
        differ, got = _differ(fleet, seed=42)
    finally:
        sabotage.set()
    assert len(differ) >= 6, f"only prompts {differ} of 8 answered differently"
    assert len([i for i in differ if not got[i].startswith("<")]) >= 3, got
    assert _differ(fleet, seed=43, n=4)[0] == []  # and the fleet is whole again


N = 8  # prompts of a load


@contextlib.contextmanager
def _started(servers, server: str, router: str) -> Iterator[None]:
    """A server of another TP size and its router, for one test: stopped at its end
    (their health checks would load the machine for the rest of the module)."""
    servers.start([server])
    servers.start([router])
    try:
        router_ready(servers[router])
        yield
    finally:
        servers[router].stop()
        servers[server].stop()


def _rooms_of_a_load(fleet, seed: int, router: str, prefill: str, decode: str) -> Dict[str, float]:
    servers, model, _ = fleet
    return rooms_of_a_load(servers, model, seed, N, router, prefill, decode, f"sglang tp {router}")


def _misplaced_heads_change_the_answers(fleet, seed: int, router: str, *modes: str) -> None:
    differ = sabotage_changes_the_answers(fleet[2], ("misplace_heads", *modes),
                                          lambda: _differ(fleet, seed=seed, router=router))
    print(f"[sglang tp] misplace_heads {modes} through {router}: prompts {differ} of 8 differ")


def test_kv_heads_move_to_a_decode_server_of_another_tp_size(fleet):
    """D1 (TP 1) behind a router with P (TP 2): SGLang maps D1's one rank to both
    prefill ranks, and each pushes its KV head into D1's pages, at its place in each
    token (a part of its own). The answers equal the reference's, D1 ended every room
    once both parts landed. Negative controls:
    the two prefill ranks' heads swapped (``misplace_heads``): D1 refuses every part
    (its units are not the ones expected), and with that check off the bytes land under
    the wrong heads and the answers differ."""
    servers, model, sabotage = fleet
    with _started(servers, "D1", "tp1"):
        ended = _rooms_of_a_load(fleet, 44, "tp1", "P", "D1")
        # every room on both of P's ranks and on D1's one rank (it waits for both parts)
        assert ended["P"] >= 2 * N and ended["D1"] >= N, ended
        with open(servers["D1"].log_path) as f:
            assert "moved by KV head (2 of 2)" in f.read()

        refused_before = count(servers["D1"].metrics(), "misaddressed_rooms")
        sabotage.set("misplace_heads")  # D1's check of the destination is on
        try:
            got = answers(servers["tp1"].url, model, random_prompts(seed=45, n=2))
        finally:
            sabotage.set()
        refused = count(servers["D1"].metrics(), "misaddressed_rooms") - refused_before
        print(f"[sglang tp] misplace_heads, checked: {refused:.0f} rooms refused; {[a[:80] for a in got]}")
        assert refused >= 2 and all(a.startswith("<") for a in got), (refused, got)
        pages_come_back(servers, ["D1", "P"])
        router_serves_again(servers, model, router="tp1")

        _misplaced_heads_change_the_answers(fleet, 46, "tp1", "unchecked")
        pages_come_back(servers, ["D1", "P"])
    router_serves_again(servers, model)
    assert _differ(fleet, seed=43, n=4)[0] == []


def test_one_prefill_rank_sends_each_decode_rank_its_kv_head(fleet):
    """P1 (TP 1) behind a router with D (TP 2): SGLang maps both decode ranks to P1's
    one rank, which sends each its KV head (reading the second head of its tokens for
    rank 1). The answers equal the reference's, and both decode ranks ended every room.
    Negative control: each decode rank handed the other's head (``misplace_heads``:
    P reads the wrong head, into the right units, so D's checks pass): the answers
    differ."""
    servers = fleet[0]
    with _started(servers, "P1", "more"):
        ended = _rooms_of_a_load(fleet, 47, "more", "P1", "D")
        assert ended["P1"] >= N and ended["D"] >= 2 * N, ended  # each decode rank every room
        _misplaced_heads_change_the_answers(fleet, 48, "more")
        pages_come_back(servers, ["P1", "D"])
    assert _differ(fleet, seed=43, n=4)[0] == []
