"""The 2P1D SGLang fleet (two prefill servers, one decode server, a monolithic reference,
sglang-router in P/D mode) of tests/test_sglang_pd.py (the gate's) and
tests/test_sglang_pd_checks.py (`make test-full`, `make test-sglang`), and the checks
both modules run with their own parameters: a sabotaged transfer changes the answers,
and a fault fails only its own requests."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from typing import Dict, Iterator, List, NamedTuple, Tuple

from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec

from serving_fleet import workspace
from sglang_fleet import (LEASE_S, PAGE_SIZE, ROUTER_CHECKS, answers, count, differ_from_reference,
                          fleet_env, key_file, pages_come_back, random_prompts, router_serves_again,
                          serving)
from vllm_sabotage import Switch

CHUNK = 256  # P1's --chunked-prefill-size; prompts are 50-800 tokens


class PdFleet(NamedTuple):
    servers: Servers
    model: str
    sabotage: Switch
    reference: Dict[str, str]  # the monolithic server's answers by prompt, kept across tests


@contextlib.contextmanager
def pd_fleet(foreign: bool) -> Iterator[PdFleet]:
    """Start the fleet, yield it, stop every process. ``foreign``: also P3, a prefill
    server with another fleet key (it waits 20 s for a destination that never comes),
    started with the fleet (a lone start leaves a core idle while it imports) and
    stopped by its test; its router, which tries each request once (its rooms fail at
    D's lease; a retry waits again), is started by that test only."""
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
            names = ["P1", "P2", "D", "ref"]
            if foreign:
                p3 = servers.add(SglangServerSpec("P3", model, role="prefill", page_size=PAGE_SIZE, env=dict(
                    env, KVOPS_FLEET_KEY_FILE=key_file(tmp, "another.key"),
                    SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="20")))
                servers.add(SglangRouterSpec("foreign", [p3], [d], extra_args=checks + ["--disable-retries"]))
                names.append("P3")
            with serving(servers, names):
                yield PdFleet(servers, model, sabotage, {})


def compare_answers(fleet: PdFleet, seed: int, n: int = 8) -> Tuple[List[int], List[str]]:
    """(indices of the answers through the router that differ from the monolithic
    server's, the answers), n prompts sent at once."""
    return differ_from_reference(fleet.servers, fleet.model, seed, n, reference=fleet.reference)


def compare(fleet: PdFleet, seed: int, n: int = 8) -> List[int]:
    """Indices of the prompts whose answer through the router differs from the
    monolithic server's (n prompts sent at once)."""
    return compare_answers(fleet, seed, n)[0]


def misplaced_or_dropped_kv_changes_the_answers(fleet: PdFleet, mode: str) -> None:
    """With D's checks switched off (``unverified``: the integrity check; ``unchecked``:
    the check of the pages a begin names)."""
    sabotage = fleet.sabotage
    sabotage.set(mode, "unverified", "unchecked")
    try:
        # prompts of their own: pages left by an earlier run of the same prompts would
        # hold the right KV
        differ, got = compare_answers(fleet, seed={"misplace": 3, "drop": 5, "drop_layer": 6}[mode])
    finally:
        sabotage.set()
    assert len(differ) >= 6, f"{mode}: only prompts {differ} of 8 answered differently"
    # wrong answers, not only errors (misplaced pages may name one page twice in a
    # step: P refuses the later room, and its client gets an error)
    wrong = [i for i in differ if not got[i].startswith("<")]
    assert len(wrong) >= 3, f"{mode}: only {len(wrong)} wrong answers: {[got[i][:200] for i in differ]}"
    assert compare(fleet, seed=4, n=4) == []  # and the fleet is whole again


FAULTS = {"kill_prefill": "P1", "kill_decode": "D", "freeze_prefill": "P1", "client_disconnects": None,
          "freeze_decode": "D"}


def when_pushing(server, timeout: float = 120.0) -> None:
    """Return once the prefill ``server`` pushed a chunk more than when called."""
    base, deadline = count(server.metrics(), "chunks"), time.monotonic() + timeout
    while count(server.metrics(), "chunks") == base:
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name} pushed nothing in {timeout:.0f} s")
        time.sleep(0.05)


def frozen_past_the_lease(server) -> None:
    """SIGSTOP the server's whole process group (a paused VM: its HTTP server,
    scheduler and transfers stop at once) for longer than D's lease, then SIGCONT. A
    frozen P resumes its queued writes, into pages D gave up; a frozen D wakes with
    every lease expired, while P gave up its pushes and may still have bytes in flight."""
    os.killpg(server.pgid, signal.SIGSTOP)
    try:
        time.sleep(LEASE_S + 10.0)
    finally:
        os.killpg(server.pgid, signal.SIGCONT)


def a_fault_fails_only_its_own_requests(fleet: PdFleet, fault: str) -> None:
    """A server killed while P1 pushes (SIGKILL of its process group), P1 or D frozen
    while P1 pushes until D's leases ended and then resumed, or clients that hang up
    after 1 s: the fault fails rooms (or requests), no answer is wrong (each is right
    or an error), every page on the servers left comes back to SGLang, and the fleet
    answers right again (a killed server restarted on its ports)."""
    servers, model = fleet.servers, fleet.model
    router_serves_again(servers, model)  # (a fresh fleet's router may hold requests at first)
    victim = FAULTS[fault]
    prompts = random_prompts(seed=10 + list(FAULTS).index(fault), n=8)
    missing = [p for p in prompts if p not in fleet.reference]
    fleet.reference.update(zip(missing, answers(servers["ref"].url, model, missing)))
    rooms_failed = {n: count(servers[n].metrics(), "rooms", label="failed") for n in ("P1", "P2", "D")}
    refused_before = {n: count(servers[n].metrics(), "refused_messages") for n in ("P1", "P2", "D")}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(answers, servers["router"].url, model, prompts,
                           1.0 if victim is None else 240.0)
        if victim is not None:
            when_pushing(servers["P1"])
            if fault.startswith("freeze"):
                frozen_past_the_lease(servers[victim])
            else:
                servers.kill(victim)
        got = load.result()
    failed = [i for i, a in enumerate(got) if a.startswith("<")]
    wrong = [i for i, (p, a) in enumerate(zip(prompts, got)) if i not in failed and a != fleet.reference[p]]
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
        assert compare(fleet, seed=40 + attempt, n=4) == []
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
