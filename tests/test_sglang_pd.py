"""SGLang P/D with this package's transfer backend: real SGLang 0.5.23 servers
(``python -m sglang.launch_server --disaggregation-mode prefill|decode
--disaggregation-transfer-backend kvops``, CPU) behind SGLang's router
(``sglang-router`` 0.3.2, P/D mode), against a monolithic SGLang server.

Two prefill servers and one decode server (2P1D), 16 prompts at once, pages of 16
tokens; one prefill server prefills in chunks of 256 tokens, so most of its rooms leave
in several chunks. SGLang's decode server never computes a prompt: it decodes from the
KV the prefill server sent. So answers equal to the reference mean the KV arrived whole
and in place, and the negative controls (P pushes to pages past the room's; P's
transport moves no byte; it moves every layer but one) show that the answers depend on
those bytes. The only stand-in is tests/sglang_standin
(two CPU kernels of sgl_kernel that have no wheel on PyPI), labelled there.

The fleet runs as a fleet beyond one host would: every server holds the fleet key
(control-channel secrets derived from it, the backend's ZMQ messages signed with it)
and D checks every layer with the integrity check's ``mac`` mode. A third prefill
server with another key (P3, behind a router of its own with the same D) moves
nothing. D also refuses a begin that names pages it did not give the room. The
negative controls switch D's checks off (sabotage modes ``unverified`` and
``unchecked``); with them on, the same faults fail their rooms and no answer is wrong.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.error
import urllib.request
from typing import Dict, List, Tuple

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec

from serving_fleet import workspace
from sglang_fleet import (LANDED_IN_FORWARD, LEASE_S, PAGE_SIZE, ROUTER_CHECKS, answers, count,
                          differ_from_reference, serving, fleet_env, key_file, pages_come_back,
                          random_prompts, router_ready, router_serves_again)

CHUNK = 256  # P1's --chunked-prefill-size; prompts are 50-800 tokens


@pytest.fixture(scope="module")
def fleet():
    with workspace("kvops-sglang") as (tmp, model, log_dir, sabotage):
        env = fleet_env(tmp)
        same = dict(env=env, page_size=PAGE_SIZE)
        checks = ROUTER_CHECKS
        with Servers(log_dir) as servers:
            p1 = servers.add(SglangServerSpec("P1", model, role="prefill",
                                              extra_args=["--chunked-prefill-size", str(CHUNK)], **same))
            p2 = servers.add(SglangServerSpec("P2", model, role="prefill", **same))
            d = servers.add(SglangServerSpec("D", model, role="decode", **same))
            servers.add(SglangServerSpec("ref", model, role="monolithic", **same))
            servers.add(SglangRouterSpec("router", [p1, p2], [d], extra_args=checks))
            # P3, a prefill server with another key (it waits 20 s for a destination
            # that never comes), started with the fleet (a lone start leaves a core
            # idle while it imports) and stopped by its test; its router, which tries
            # each request once (its rooms fail at D's lease; a retry waits again), is
            # started by that test only
            p3 = servers.add(SglangServerSpec("P3", model, role="prefill", page_size=PAGE_SIZE, env=dict(
                env, KVOPS_FLEET_KEY_FILE=key_file(tmp, "another.key"),
                SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="20")))
            servers.add(SglangRouterSpec("foreign", [p3], [d], extra_args=checks + ["--disable-retries"]))
            with serving(servers, ["P1", "P2", "D", "ref", "P3"]):
                yield servers, model, sabotage


_reference: Dict[str, str] = {}


def _compare(fleet, seed: int, n: int = 8) -> List[int]:
    """Indices of the prompts whose answer through the router differs from the
    monolithic server's (n prompts sent at once)."""
    return _compare_answers(fleet, seed, n)[0]


def _compare_answers(fleet, seed: int, n: int = 8) -> Tuple[List[int], List[str]]:
    """(indices of the answers that differ from the monolithic server's, the answers)."""
    servers, model, _ = fleet
    return differ_from_reference(servers, model, seed, n, reference=_reference)


def test_router_answers_equal_the_monolithic_server_and_prefill_pushes_layer_by_layer(fleet):
    servers = fleet[0]
    assert _compare(fleet, seed=1, n=16) == []
    assert _compare(fleet, seed=2, n=16) == []  # the pages of the first load are reused
    p1, p2, d = (prometheus.fetch(servers[name].url) for name in ("P1", "P2", "D"))
    # the router spread the rooms over both prefill servers; each reached D whole
    rooms = [count(p, "rooms", label="success") for p in (p1, p2)]
    assert min(rooms) >= 8 and sum(rooms) >= 32, rooms
    assert count(d, "rooms", label="success") >= 32
    # D computed no prompt token: SGLang's own prefill counter on D stays at 0 (P's counts)
    prefilled = [prometheus.total(s, "sglang:prefill_effective_tokens_total", mode="input")
                 for s in (p1, p2, d)]
    assert prefilled[2] == 0 and min(prefilled[:2]) > 0, prefilled
    assert not any(count(s, "rooms", label="failed") for s in (p1, p2, d))
    # rooms waited in the prefill queues; their leases were renewed while they did
    assert count(d, "lease_renewals") > 0
    # every chunk left in its forward, layer by layer (SGLang starts a prefill once its
    # destination is known); none waited for the forward's end
    for p in (p1, p2):
        assert count(p, "chunks", label="after_forward") == 0
    # P1's rooms left in more chunks than rooms (prefill chunked by 256 tokens)
    assert count(p1, "chunks", label="forward") > rooms[0] + 8
    layers = sum(count(p, "layers") for p in (p1, p2))
    early = sum(count(p, "layers_landed_during_forward") for p in (p1, p2))
    print(f"\n[sglang] {early:.0f} of {layers:.0f} pushed layers landed before their forward ended")
    # most layers land while later ones compute
    assert layers > 0 and early >= layers * LANDED_IN_FORWARD, (early, layers)


IDLE_S = 5.0


def _cpu_s(server) -> float:
    """CPU seconds (user + system) the server's processes have used."""
    total = 0
    for pid in server.processes():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def test_idle_servers_use_next_to_no_cpu(fleet):
    """An idle server (its scheduler asleep: --sleep-on-idle; the backend's threads
    blocked) uses next to no CPU. Seen red: the backend's outcome thread spun while no
    transfer was in flight, a core per server, beside the busy ones."""
    servers = fleet[0]
    before = {name: _cpu_s(servers[name]) for name in ("P1", "P2", "D")}
    time.sleep(IDLE_S)
    used = {name: round(_cpu_s(servers[name]) - before[name], 2) for name in before}
    print(f"\n[sglang] CPU seconds used in {IDLE_S:.0f} s idle: {used}")
    assert all(u < 0.2 * IDLE_S for u in used.values()), used


@pytest.mark.parametrize("mode", ["misplace", "drop", "drop_layer"])
def test_negative_control_misplaced_or_dropped_kv_changes_the_answers(fleet, mode):
    """With D's checks switched off (``unverified``: the integrity check; ``unchecked``:
    the check of the pages a begin names)."""
    _, _, sabotage = fleet
    sabotage.set(mode, "unverified", "unchecked")
    try:
        # prompts of their own: pages left by an earlier run of the same prompts would
        # hold the right KV
        differ, got = _compare_answers(fleet, seed={"misplace": 3, "drop": 5, "drop_layer": 6}[mode])
    finally:
        sabotage.set()
    assert len(differ) >= 6, f"{mode}: only prompts {differ} of 8 answered differently"
    # wrong answers, not only errors (misplaced pages may name one page twice in a
    # step: P refuses the later room, and its client gets an error)
    wrong = [i for i in differ if not got[i].startswith("<")]
    assert len(wrong) >= 3, f"{mode}: only {len(wrong)} wrong answers: {[got[i][:200] for i in differ]}"
    assert _compare(fleet, seed=4, n=4) == []  # and the fleet is whole again


# the fault -> D's check that catches it (its counter)
CAUGHT_BY = {"misplace": "misaddressed_rooms", "drop": "integrity_failures",
             "drop_layer": "integrity_failures"}


@pytest.mark.parametrize("mode", list(CAUGHT_BY))
def test_d_fails_every_room_whose_kv_is_misplaced_or_did_not_arrive(fleet, mode):
    """The faults of the negative controls above with D's checks on: D refuses the
    begins that name pages past the room's own (nothing is written there), and fails
    the rooms whose pages differ from what P digested (every layer, or one). No answer
    is wrong, every page comes back, and the fleet answers right again."""
    servers, model, sabotage = fleet
    prompts = random_prompts(seed={"misplace": 16, "drop": 13, "drop_layer": 14}[mode], n=8)
    _reference.update(zip(prompts, answers(servers["ref"].url, model, prompts)))
    before = count(servers["D"].metrics(), CAUGHT_BY[mode])
    sabotage.set(mode)
    try:
        got = answers(servers["router"].url, model, prompts)
    finally:
        sabotage.set()
    caught = count(servers["D"].metrics(), CAUGHT_BY[mode]) - before
    wrong = [a for p, a in zip(prompts, got) if not a.startswith("<") and a != _reference[p]]
    print(f"\n[sglang] checked, {mode}: {caught:.0f} rooms failed D's check (the router retries "
          f"a failed room as a new one); {len([a for a in got if a.startswith('<')])} of 8 "
          f"requests failed, {len(wrong)} wrong")
    assert not wrong, wrong
    assert caught >= 8, f"{mode}: D's check failed only {caught:.0f} rooms"
    pages_come_back(servers, ["P1", "P2", "D"])
    router_serves_again(servers, model)  # D's failures opened the router's circuit for it
    assert _compare(fleet, seed=4, n=4) == []


def test_a_prefill_server_with_another_fleet_key_moves_nothing(fleet):
    """P3 holds another key than D: each refuses the other's messages (D's registration
    and destinations at P3; nothing of P3's reaches D's rooms), so every request
    through P3's router fails (none is answered wrong, D decodes from no KV of P3's),
    D's pages come back, and the fleet answers right."""
    servers, model, _ = fleet
    servers.start(["foreign"])
    try:
        router_ready(servers["foreign"])
        prompts = random_prompts(seed=15, n=2)
        got = answers(servers["foreign"].url, model, prompts)
        refused = count(servers["P3"].metrics(), "refused_messages")
        print(f"\n[sglang] another key: {refused:.0f} messages of D refused at P3; answers "
              f"{[a[:160] for a in got]}")
        assert all(a.startswith("<") for a in got), got
        assert refused >= 2, "P3 took D's messages"  # a registration and a room's destination
        assert count(servers["P3"].metrics(), "rooms", label="success") == 0
        pages_come_back(servers, ["P3", "D"])
    finally:  # its health checks would load the machine for the rest of the module
        servers["foreign"].stop()
        servers["P3"].stop()
    assert _compare(fleet, seed=4, n=4) == []


@pytest.mark.parametrize("renewals", ["owed_notices", "no_renewal"])
def test_owed_notices_keep_rooms_of_a_long_prefill_queue_alive(fleet, renewals):
    """Each prefill forward starts 2 s late (``slow_prefill``) and D gives each room a
    lease of 5 s (``short_lease``), so P1's rooms (chunks of 256 tokens) wait in its
    queue far longer than their lease, on a machine of any speed. With the prefill
    servers' notices of the rooms they owe, D renews those leases and no room fails.
    Negative control (``no_renewal``: D drops the notices): rooms fail there, and no
    answer is wrong."""
    servers, model, sabotage = fleet
    prompts = random_prompts(seed={"owed_notices": 9, "no_renewal": 8}[renewals], n=12)
    _reference.update(zip(prompts, answers(servers["ref"].url, model, prompts)))
    failed_before = count(servers["D"].metrics(), "rooms", label="failed")
    renewed_before = count(servers["D"].metrics(), "lease_renewals")
    sabotage.set("short_lease", "slow_prefill", "no_renewal" if renewals == "no_renewal" else "")
    try:
        got = answers(servers["router"].url, model, prompts)
    finally:
        sabotage.set()
    d = servers["D"].metrics()
    failed = count(d, "rooms", label="failed") - failed_before
    renewed = count(d, "lease_renewals") - renewed_before
    print(f"\n[sglang] {renewals}: {failed:.0f} rooms failed on D (12 requests; the router "
          f"retries a failed room as a new one), {renewed:.0f} leases renewed; "
          f"{len([a for a in got if a.startswith('<')])} requests failed")
    assert not [a for p, a in zip(prompts, got) if not a.startswith("<") and a != _reference[p]]
    if renewals == "owed_notices":
        assert failed == 0 and renewed > 0, (failed, renewed)
    else:
        assert renewed == 0
        assert failed >= 1, "every room reached D within its lease: the control shows nothing"
    pages_come_back(servers, ["P1", "P2", "D"])
    router_serves_again(servers, model)  # failed rooms may have opened the router's circuit for D
    assert _compare(fleet, seed=4, n=4) == []  # and the fleet is whole again


def _when_pushing(server, timeout: float = 120.0) -> None:
    """Return once the prefill ``server`` pushed a chunk more than when called."""
    base, deadline = count(server.metrics(), "chunks"), time.monotonic() + timeout
    while count(server.metrics(), "chunks") == base:
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name} pushed nothing in {timeout:.0f} s")
        time.sleep(0.05)


@pytest.mark.parametrize("notice", ["signed", "unsigned"])
def test_a_request_aborted_on_d_stops_its_prefill_by_a_signed_notice(fleet, notice):
    """Requests aborted on the decode server while their prefills wait (SGLang's
    ``/abort_request``, as an operator or a gateway calls it; each prefill forward
    starts late: ``slow_prefill``): D tells the prefill server with SGLang's own abort
    notice, signed like the backend's messages; the prefill server takes it (counted)
    and refuses nothing, the requests end, and every page comes back. Negative control
    (``unsigned``: D sends the notice unsigned): the prefill servers refuse it and never
    hear of the abort; no answer is wrong either way."""
    servers, model, sabotage = fleet
    router_serves_again(servers, model)
    names = ("P1", "P2", "D")
    aborts_before = sum(count(servers[n].metrics(), "abort_notices") for n in ("P1", "P2"))
    refused_before = {n: count(servers[n].metrics(), "refused_messages") for n in names}
    sabotage.set("slow_prefill", "unsigned_aborts" if notice == "unsigned" else "")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            prompts = random_prompts(seed=12, n=2)
            _reference.update(zip(prompts, answers(servers["ref"].url, model, prompts)))
            load = pool.submit(answers, servers["router"].url, model, prompts, 120.0)
            time.sleep(1.0)  # D holds both rooms, their prefills wait
            abort = urllib.request.Request(f"{servers['D'].url}/abort_request", method="POST",
                                           data=json.dumps({"abort_all": True}).encode(),
                                           headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(abort, timeout=30.0) as resp:
                assert resp.status == 200
            got = load.result()
    finally:
        sabotage.set()
    settled_s = pages_come_back(servers, list(names))
    aborts = sum(count(servers[n].metrics(), "abort_notices") for n in ("P1", "P2")) - aborts_before
    refused = {n: count(servers[n].metrics(), "refused_messages") - refused_before[n] for n in names}
    print(f"\n[sglang] aborted on D, notice {notice}: answers {[a[:80] for a in got]}; abort notices "
          f"taken by the prefill servers {aborts:.0f}; messages refused {refused}; pages back "
          f"{settled_s:.0f} s after")
    if notice == "unsigned":
        assert aborts == 0 and refused["P1"] + refused["P2"] >= 1, (aborts, refused)
    else:
        assert aborts >= 1 and not any(refused.values()), (aborts, refused)
    # each right or an error (sglang-router may retry an aborted request as a new room)
    assert all(a.startswith("<") or a == _reference[p] for p, a in zip(prompts, got)), got
    router_serves_again(servers, model)
    assert _compare(fleet, seed=4, n=4) == []


FAULTS = {"kill_prefill": "P1", "kill_decode": "D", "freeze_prefill": "P1", "client_disconnects": None,
          "freeze_decode": "D"}


def _frozen_past_the_lease(server) -> None:
    """SIGSTOP the server's whole process group (a paused VM: its HTTP server,
    scheduler and transfers stop at once) for longer than D's lease, then SIGCONT. A
    frozen P resumes its queued writes, into pages D gave up; a frozen D wakes with
    every lease expired, while P gave up its pushes and may still have bytes in flight."""
    os.killpg(server.pgid, signal.SIGSTOP)
    try:
        time.sleep(LEASE_S + 10.0)
    finally:
        os.killpg(server.pgid, signal.SIGCONT)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_fails_only_its_own_requests_and_every_page_comes_back(fleet, fault):
    """A server killed while P1 pushes (SIGKILL of its process group), P1 or D frozen
    while P1 pushes until D's leases ended and then resumed, or clients that hang up
    after 1 s: the fault fails rooms (or requests), no answer is wrong (each is right
    or an error), every page on the servers left comes back to SGLang, and the fleet
    answers right again (a killed server restarted on its ports)."""
    servers, model, _ = fleet
    router_serves_again(servers, model)  # (a fresh fleet's router may hold requests at first)
    victim = FAULTS[fault]
    prompts = random_prompts(seed=10 + list(FAULTS).index(fault), n=8)
    missing = [p for p in prompts if p not in _reference]
    _reference.update(zip(missing, answers(servers["ref"].url, model, missing)))
    rooms_failed = {n: count(servers[n].metrics(), "rooms", label="failed") for n in ("P1", "P2", "D")}
    refused_before = {n: count(servers[n].metrics(), "refused_messages") for n in ("P1", "P2", "D")}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(answers, servers["router"].url, model, prompts,
                           1.0 if victim is None else 240.0)
        if victim is not None:
            _when_pushing(servers["P1"])
            if fault.startswith("freeze"):
                _frozen_past_the_lease(servers[victim])
            else:
                servers.kill(victim)
        got = load.result()
    failed = [i for i, a in enumerate(got) if a.startswith("<")]
    wrong = [i for i, (p, a) in enumerate(zip(prompts, got)) if i not in failed and a != _reference[p]]
    killed = victim if fault.startswith("kill") else None
    left = [n for n in ("P1", "P2", "D") if n != killed]
    settled_s = pages_come_back(servers, left)
    # the rooms the fault failed on the servers left (sglang-router retries a request
    # whose transfer failed, so its client may never see the fault)
    hit = {n: count(servers[n].metrics(), "rooms", label="failed") - rooms_failed[n] for n in left}
    refused = {n: count(servers[n].metrics(), "refused_messages") - refused_before[n] for n in left}
    print(f"\n[sglang] {fault}: {len(failed)} of 8 requests failed, {len(wrong)} wrong; rooms failed "
          f"{hit}; pages of {left} back {settled_s:.0f} s after the load; messages refused "
          f"{refused}; first error: {[got[i][:160] for i in failed[:1]]}")
    assert not wrong, [got[i] for i in wrong]
    assert not any(refused.values()), "a server of the fleet refused a message of the fleet"
    assert failed or any(hit.values()), "the fault hit no request: nothing was shown"
    if victim is not None:
        if killed:
            servers.restart(killed, 600)
        router_serves_again(servers, model)
    # the fleet is whole again; a restarted prefill server is back in the router's
    # rotation (its health checks pass) and pushes its share of rooms
    # new prompts each time (a seen prefix is routed where it went before), for up to
    # 90 s: sglang-router takes the restarted server back after its health checks pass
    deadline = time.monotonic() + 90.0
    for attempt in range(100):
        assert _compare(fleet, seed=40 + attempt, n=4) == []
        served = count(servers["P1"].metrics(), "rooms", label="success")
        if victim != "P1" or served or time.monotonic() > deadline:
            break
        time.sleep(3.0)
    # links stay flat: one per decode rank on each prefill server, whatever the fault
    # did to them (a dead D's link is closed, a broken one made again, not added)
    links = {n: {event: count(servers[n].metrics(), "links", label=event)
                 for event in ("made", "broken", "remade", "released")} for n in ("P1", "P2")}
    live = {n: c["made"] - c["released"] for n, c in links.items()}
    print(f"[sglang] after the fault P1 pushed {served:.0f} rooms ({attempt + 1} loads); links to "
          f"decode ranks {links}, live {live}")
    assert served >= 1
    assert all(n <= 1 for n in live.values()), f"links to decode ranks pile up: {live}"
