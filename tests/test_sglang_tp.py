"""SGLang P/D with tensor parallelism and the ``kvops`` backend: real SGLang 0.5.23
servers with ``--tp-size 2`` on both sides behind sglang-router (P/D mode), against a
monolithic SGLang server with the same TP (its reductions in the same order).

Each prefill rank holds its share of the KV heads and pushes its own pages to the
decode rank SGLang's rank mapping names (equal attention TP: the same rank), over its
own connector and Mooncake engine. A decode server of another TP size fails its rooms
before any destination goes out, with the reason (MHA heads are not sliced).

Stand-ins (test-only, labelled in tests/sglang_standin): the two CPU kernels of
sgl_kernel, and PyNccl turned off for SGLang's CPU groups (SGLang 0.5.23 asks a CPU
server for it); each rank is bound to one core (``SGLANG_CPU_OMP_THREADS_BIND``).
"""
from __future__ import annotations

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec

from serving_fleet import workspace
from sglang_fleet import (PAGE_SIZE, ROUTER_CHECKS, answers, count, differ_from_reference, fleet_env,
                          pages_come_back, random_prompts, serving, router_ready, router_serves_again)

CHUNK = 256  # P's --chunked-prefill-size; prompts are 50-800 tokens
TP2 = ["--tp-size", "2"]
MISMATCH = "the kvops backend moves KV between equal attention TP sizes only"


@pytest.fixture(scope="module")
def fleet():
    with workspace("kvops-sglang-tp") as (tmp, model, log_dir, sabotage):
        env = fleet_env(tmp, "cpu_tp_groups")
        tp2 = dict(env=dict(env, SGLANG_CPU_OMP_THREADS_BIND="0|1"), page_size=PAGE_SIZE)
        with Servers(log_dir) as servers:
            p = servers.add(SglangServerSpec("P", model, role="prefill",
                                             extra_args=TP2 + ["--chunked-prefill-size", str(CHUNK)], **tp2))
            d = servers.add(SglangServerSpec("D", model, role="decode", extra_args=TP2, **tp2))
            servers.add(SglangServerSpec("ref", model, role="monolithic", extra_args=TP2, **tp2))
            servers.add(SglangRouterSpec("router", [p], [d], extra_args=ROUTER_CHECKS))
            # started by its test only: a decode server with TP 1, behind a router of
            # its own with P that tries each request once
            d1 = servers.add(SglangServerSpec("D1", model, role="decode", env=env, page_size=PAGE_SIZE))
            servers.add(SglangRouterSpec("tp1", [p], [d1], extra_args=ROUTER_CHECKS + ["--disable-retries"]))
            with serving(servers, ["P", "D", "ref"]):
                yield servers, model, sabotage


def _differ(fleet, seed: int, n: int = 8):
    servers, model, _ = fleet
    return differ_from_reference(servers, model, seed, n, "sglang tp")


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
    # most layers land while later ones compute: pushed only as the forward ends
    # (no hook after the KV writes), 3-6 of 84-88 did in the MLA fleet
    assert layers > 0 and early >= layers / 2, (early, layers)


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


def test_a_decode_server_of_another_tp_size_fails_its_rooms_with_the_reason(fleet):
    """D1 (TP 1) behind a router with P (TP 2): each room fails on D1 before its
    destination goes out (nothing written), the client gets an error, not an answer,
    and the pages come back on both sides."""
    servers, model, _ = fleet
    servers.start(["D1"])
    servers.start(["tp1"])
    try:
        router_ready(servers["tp1"])
        before = count(servers["D1"].metrics(), "rooms", label="failed")
        got = answers(servers["tp1"].url, model, random_prompts(seed=44, n=2))
        failed = count(servers["D1"].metrics(), "rooms", label="failed") - before
        print(f"\n[sglang tp] D1 (TP 1): {failed:.0f} rooms failed; answers {[a[:200] for a in got]}")
        assert all(a.startswith("<") for a in got), got
        assert failed >= 2
        with open(servers["D1"].log_path) as f:
            assert MISMATCH in f.read()
        pages_come_back(servers, ["D1", "P"])
    finally:  # its health checks would load the machine for the rest of the module
        servers["tp1"].stop()
        servers["D1"].stop()
    router_serves_again(servers, model)
    assert _differ(fleet, seed=43, n=4)[0] == []
