"""SGLang P/D of an MLA model with the ``kvops`` backend: real SGLang 0.5.23 servers
behind sglang-router (P/D mode), against a monolithic SGLang server, as in
tests/test_sglang_pd.py, with the test DeepSeek-V2-style model
(torch_kvops/testing/mla_model.py: MLA attention, 4 layers, a 576-wide latent per
token). SGLang's MLA pool holds one latent buffer per layer (no K and V): the prefill
server pushes each layer's latent pages as its forward writes them.

One prefill server with TP 2 (chunks of 256 tokens), one decode server with TP 1: each
prefill rank holds the whole latent, SGLang's rank mapping names rank 0 to send and
gives rank 1 a dummy destination, which ends its room without a transfer. The fleet
key and D's ``mac`` integrity check. Stand-ins (test-only, labelled in tests/sglang_standin): the
two CPU kernels of sgl_kernel, the dispatch of SGLang's absorbed MLA form to its
``torch_native`` attention (SGLang runs DeepSeek attention on CPU only on AMX), in
every server alike, the reference included, and PyNccl turned off for SGLang's CPU
groups (tests/test_sglang_tp.py).
"""
from __future__ import annotations

from typing import Dict

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec
from torch_kvops.testing.mla_model import PLAIN_YARN

from serving_fleet import workspace
from sglang_fleet import (LANDED_IN_FORWARD, PAGE_SIZE, ROUTER_CHECKS, answers, count,
                          differ_from_reference, fleet_env, pages_come_back, random_prompts,
                          router_ready, router_serves_again, sabotage_changes_the_answers, serving)

pytestmark = [pytest.mark.fleet, pytest.mark.sglang]

CHUNK = 256  # P's --chunked-prefill-size; prompts are 50-800 tokens


@pytest.fixture(scope="module")
def fleet():
    with workspace("kvops-sglang-mla", mla=True, rope_scaling=PLAIN_YARN) as (tmp, model, log_dir, sabotage):
        env = fleet_env(tmp, "cpu_mla_dispatch", "cpu_tp_groups")
        same = dict(env=env, page_size=PAGE_SIZE)
        with Servers(log_dir) as servers:
            # P with TP 2, D with TP 1: each prefill rank holds the whole latent, SGLang
            # names rank 0 to send D's pages and sends rank 1 a dummy destination
            p = servers.add(SglangServerSpec(
                "P", model, role="prefill", env=dict(env, SGLANG_CPU_OMP_THREADS_BIND="0|1"),
                page_size=PAGE_SIZE, extra_args=["--tp-size", "2", "--chunked-prefill-size", str(CHUNK)]))
            d = servers.add(SglangServerSpec("D", model, role="decode", **same))
            servers.add(SglangServerSpec("ref", model, role="monolithic", **same))
            servers.add(SglangRouterSpec("router", [p], [d], extra_args=ROUTER_CHECKS))
            # started by their test only: D2 (TP 2) behind a router with P (equal TP)
            # and behind another with P1 (TP 1: more decode ranks than prefill ranks)
            d2 = servers.add(SglangServerSpec(
                "D2", model, role="decode", env=dict(env, SGLANG_CPU_OMP_THREADS_BIND="0|1"),
                page_size=PAGE_SIZE, extra_args=["--tp-size", "2"]))
            p1 = servers.add(SglangServerSpec("P1", model, role="prefill", **same))
            servers.add(SglangRouterSpec("equal", [p], [d2], extra_args=ROUTER_CHECKS))
            servers.add(SglangRouterSpec("fewer", [p1], [d2], extra_args=ROUTER_CHECKS))
            with serving(servers, ["P", "D", "ref"]):
                yield servers, model, sabotage


def _differ(fleet, seed: int, n: int = 8, router: str = "router"):
    servers, model, _ = fleet
    return differ_from_reference(servers, model, seed, n, f"sglang mla {router}", _reference, router)


_reference: Dict[str, str] = {}


def test_the_mla_model_answers_from_its_context(fleet):
    """Prompts that share their last words but not what comes before answer
    differently on the monolithic server: a transfer that moved no KV could not give
    the reference's answers."""
    servers, model, _ = fleet
    tail = " w500 w501 w502"
    prompts = [p + tail for p in random_prompts(seed=30, n=4)]
    got = answers(servers["ref"].url, model, prompts)
    assert not [a for a in got if a.startswith("<")], got
    assert len(set(got)) == len(got), got


def test_router_answers_equal_the_monolithic_server_and_prefill_pushes_each_latent_layer(fleet):
    servers = fleet[0]
    n = 12
    assert _differ(fleet, seed=31, n=n)[0] == []
    p, d = (prometheus.fetch(servers[name].url) for name in ("P", "D"))
    # both prefill ranks ended every room: rank 1 (its destination a dummy) sends nothing
    assert count(p, "rooms", label="success") >= 2 * n and count(d, "rooms", label="success") >= n
    assert not any(count(s, "rooms", label="failed") for s in (p, d))
    # D's cache lists both prefill ranks under one entry: neither looks restarted
    assert count(d, "prefill_restarts") == 0
    # D computed no prompt token: SGLang's own prefill counter on D stays at 0
    prefilled = [prometheus.total(s, "sglang:prefill_effective_tokens_total", mode="input") for s in (p, d)]
    assert prefilled[1] == 0 and prefilled[0] > 0, prefilled
    # every chunk left in its forward, one latent layer at a time, in more chunks than
    # rooms (chunked prefill)
    assert count(p, "chunks", label="after_forward") == 0
    assert count(p, "chunks", label="forward") > count(d, "rooms", label="success")
    layers, early = count(p, "layers"), count(p, "layers_landed_during_forward")
    print(f"\n[sglang mla] {early:.0f} of {layers:.0f} pushed layers landed before their forward ended")
    # most layers land while later ones compute
    assert layers > 0 and early >= layers * LANDED_IN_FORWARD, (early, layers)
    pages_come_back(servers, ["P", "D"])  # P frees a room's pages once both ranks ended it


@pytest.mark.parametrize("mode", ["drop", "drop_layer"])
def test_negative_control_dropped_latents_change_the_answers(fleet, mode):
    """P's transport moves no byte (``drop``), or none of layer 1's latent
    (``drop_layer``), with D's checks switched off (``unverified``, ``unchecked``)."""
    seed = {"drop": 32, "drop_layer": 33}[mode]
    sabotage_changes_the_answers(fleet[2], (mode, "unverified", "unchecked"), lambda: _differ(fleet, seed))
    assert _differ(fleet, seed=34, n=4)[0] == []  # and the fleet is whole again


def test_d_fails_every_room_whose_latent_layer_did_not_arrive(fleet):
    """The same fault with D's checks on: the integrity check fails each room whose
    layer-1 latent pages differ from what P digested; no answer is wrong, every page
    comes back, and the fleet answers right again."""
    servers, model, sabotage = fleet
    prompts = random_prompts(seed=35, n=8)
    want = answers(servers["ref"].url, model, prompts)
    before = count(servers["D"].metrics(), "integrity_failures")
    sabotage.set("drop_layer")
    try:
        got = answers(servers["router"].url, model, prompts)
    finally:
        sabotage.set()
    caught = count(servers["D"].metrics(), "integrity_failures") - before
    wrong = [a for a, b in zip(got, want) if not a.startswith("<") and a != b]
    print(f"\n[sglang mla] drop_layer checked: {caught:.0f} rooms failed D's check; "
          f"{len([a for a in got if a.startswith('<')])} of 8 requests failed, {len(wrong)} wrong")
    assert not wrong, wrong
    assert caught >= 8, f"D's check failed only {caught:.0f} rooms"
    pages_come_back(servers, ["P", "D"])
    router_serves_again(servers, model)  # D's failures opened the router's circuit for it
    assert _differ(fleet, seed=34, n=4)[0] == []


def test_latents_move_between_equal_tp_sizes_and_to_more_decode_ranks(fleet):
    """D2 (TP 2) behind a router with P (TP 2): each decode rank takes the latent from
    its own prefill rank, no dummy. Behind another with P1 (TP 1): SGLang maps both
    decode ranks to P1's one rank, which pushes the whole latent to each. Through
    both, the answers equal the reference's, each decode rank ended every room, D2
    computed no prompt token, and every page comes back. Negative control: through
    P1, no byte moved (``drop``, D2's checks off): the answers differ."""
    servers, model, sabotage = fleet
    servers.start(["D2", "P1"], 600)
    servers.start(["equal", "fewer"], 600)
    try:
        for router, prefill, seed in (("equal", "P", 36), ("fewer", "P1", 37)):
            router_ready(servers[router])
            before = {n: count(servers[n].metrics(), "rooms", label="success") for n in (prefill, "D2")}
            assert _differ(fleet, seed, n=8, router=router)[0] == []
            ended = {n: count(servers[n].metrics(), "rooms", label="success") - before[n]
                     for n in (prefill, "D2")}
            print(f"[sglang mla] {router}: rooms ended {ended}")
            # 8 rooms on each of D2's 2 ranks; on each prefill rank (P: 2, P1: 1)
            assert ended["D2"] >= 16 and ended[prefill] >= 8 * (2 if prefill == "P" else 1), ended
        d2 = servers["D2"].metrics()
        assert prometheus.total(d2, "sglang:prefill_effective_tokens_total", mode="input") == 0
        assert not count(d2, "rooms", label="failed") and not count(d2, "prefill_restarts")
        pages_come_back(servers, ["P", "P1", "D2"])
        # negative control: P1's two transfers of each room move no byte (D2's checks
        # off), so D2's ranks decode from pages that hold no prompt
        sabotage.set("drop", "unverified", "unchecked")
        try:
            differ, got = _differ(fleet, seed=38, n=8, router="fewer")
        finally:
            sabotage.set()
        assert len(differ) >= 6, f"drop through 'fewer': only prompts {differ} of 8 differ"
        assert len([i for i in differ if not got[i].startswith("<")]) >= 3, got
    finally:  # their health checks would load the machine for the rest of the module
        for name in ("equal", "fewer", "D2", "P1"):
            servers[name].stop()
