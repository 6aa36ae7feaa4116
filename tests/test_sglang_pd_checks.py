"""SGLang P/D with this package's transfer backend: the checks of the 2P1D fleet
(tests/sglang_pd.py) beyond the gate's (tests/test_sglang_pd.py), in `make test-full`
and `make test-sglang`. Real SGLang 0.5.23 servers behind SGLang's router
(``sglang-router`` 0.3.2, P/D mode), against a monolithic SGLang server.

- Idle servers use next to no CPU.
- The negative controls the gate does not run (P pushes to pages past the room's; P's
  transport moves every layer but one), with D's checks switched off (sabotage modes
  ``unverified`` and ``unchecked``); with them on, the same faults and the gate's
  (no byte moved) fail their rooms and no answer is wrong.
- A third prefill server with another key (P3, behind a router of its own with the
  same D) moves nothing.
- Owed-room notices keep the leases of rooms waiting in a long prefill queue alive;
  a request aborted on D stops its prefill by a signed notice.
- The faults the gate does not run: a prefill server killed, P or D frozen past the
  lease and resumed, clients that hang up.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.request

import pytest

from sglang_fleet import (answers, count, pages_come_back, random_prompts, router_ready,
                          router_serves_again)
from sglang_pd import (FAULTS, a_fault_fails_only_its_own_requests, compare,
                       misplaced_or_dropped_kv_changes_the_answers, pd_fleet)

pytestmark = [pytest.mark.fleet, pytest.mark.sglang]


@pytest.fixture(scope="module")
def fleet():
    with pd_fleet(foreign=True) as fleet:
        yield fleet


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
    servers = fleet.servers
    before = {name: _cpu_s(servers[name]) for name in ("P1", "P2", "D")}
    time.sleep(IDLE_S)
    used = {name: round(_cpu_s(servers[name]) - before[name], 2) for name in before}
    print(f"\n[sglang] CPU seconds used in {IDLE_S:.0f} s idle: {used}")
    assert all(u < 0.2 * IDLE_S for u in used.values()), used


@pytest.mark.parametrize("mode", ["misplace", "drop_layer"])
def test_negative_control_misplaced_or_dropped_kv_changes_the_answers(fleet, mode):
    """tests/sglang_pd.py: misplaced_or_dropped_kv_changes_the_answers."""
    misplaced_or_dropped_kv_changes_the_answers(fleet, mode)


# the fault -> D's check that catches it (its counter)
CAUGHT_BY = {"misplace": "misaddressed_rooms", "drop": "integrity_failures",
             "drop_layer": "integrity_failures"}


@pytest.mark.parametrize("mode", list(CAUGHT_BY))
def test_d_fails_every_room_whose_kv_is_misplaced_or_did_not_arrive(fleet, mode):
    """The faults of the negative controls above with D's checks on: D refuses the
    begins that name pages past the room's own (nothing is written there), and fails
    the rooms whose pages differ from what P digested (every layer, or one). No answer
    is wrong, every page comes back, and the fleet answers right again."""
    servers, model, sabotage = fleet.servers, fleet.model, fleet.sabotage
    prompts = random_prompts(seed={"misplace": 16, "drop": 13, "drop_layer": 14}[mode], n=8)
    fleet.reference.update(zip(prompts, answers(servers["ref"].url, model, prompts)))
    before = count(servers["D"].metrics(), CAUGHT_BY[mode])
    sabotage.set(mode)
    try:
        got = answers(servers["router"].url, model, prompts)
    finally:
        sabotage.set()
    caught = count(servers["D"].metrics(), CAUGHT_BY[mode]) - before
    wrong = [a for p, a in zip(prompts, got) if not a.startswith("<") and a != fleet.reference[p]]
    print(f"\n[sglang] checked, {mode}: {caught:.0f} rooms failed D's check (the router retries "
          f"a failed room as a new one); {len([a for a in got if a.startswith('<')])} of 8 "
          f"requests failed, {len(wrong)} wrong")
    assert not wrong, wrong
    assert caught >= 8, f"{mode}: D's check failed only {caught:.0f} rooms"
    pages_come_back(servers, ["P1", "P2", "D"])
    router_serves_again(servers, model)  # D's failures opened the router's circuit for it
    assert compare(fleet, seed=4, n=4) == []


def test_a_prefill_server_with_another_fleet_key_moves_nothing(fleet):
    """P3 holds another key than D: each refuses the other's messages (D's registration
    and destinations at P3; nothing of P3's reaches D's rooms), so every request
    through P3's router fails (none is answered wrong, D decodes from no KV of P3's),
    D's pages come back, and the fleet answers right."""
    servers, model = fleet.servers, fleet.model
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
    assert compare(fleet, seed=4, n=4) == []


@pytest.mark.parametrize("renewals", ["owed_notices", "no_renewal"])
def test_owed_notices_keep_rooms_of_a_long_prefill_queue_alive(fleet, renewals):
    """Each prefill forward starts 2 s late (``slow_prefill``) and D gives each room a
    lease of 5 s (``short_lease``), so P1's rooms (chunks of 256 tokens) wait in its
    queue far longer than their lease, on a machine of any speed. With the prefill
    servers' notices of the rooms they owe, D renews those leases and no room fails.
    Negative control (``no_renewal``: D drops the notices): rooms fail there, and no
    answer is wrong."""
    servers, model, sabotage = fleet.servers, fleet.model, fleet.sabotage
    prompts = random_prompts(seed={"owed_notices": 9, "no_renewal": 8}[renewals], n=12)
    fleet.reference.update(zip(prompts, answers(servers["ref"].url, model, prompts)))
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
    assert not [a for p, a in zip(prompts, got) if not a.startswith("<") and a != fleet.reference[p]]
    if renewals == "owed_notices":
        assert failed == 0 and renewed > 0, (failed, renewed)
    else:
        assert renewed == 0
        assert failed >= 1, "every room reached D within its lease: the control shows nothing"
    pages_come_back(servers, ["P1", "P2", "D"])
    router_serves_again(servers, model)  # failed rooms may have opened the router's circuit for D
    assert compare(fleet, seed=4, n=4) == []  # and the fleet is whole again


@pytest.mark.parametrize("notice", ["signed", "unsigned"])
def test_a_request_aborted_on_d_stops_its_prefill_by_a_signed_notice(fleet, notice):
    """Requests aborted on the decode server while their prefills wait (SGLang's
    ``/abort_request``, as an operator or a gateway calls it; each prefill forward
    starts late: ``slow_prefill``): D tells the prefill server with SGLang's own abort
    notice, signed like the backend's messages; the prefill server takes it (counted)
    and refuses nothing, the requests end, and every page comes back. Negative control
    (``unsigned``: D sends the notice unsigned): the prefill servers refuse it and never
    hear of the abort; no answer is wrong either way."""
    servers, model, sabotage = fleet.servers, fleet.model, fleet.sabotage
    router_serves_again(servers, model)
    names = ("P1", "P2", "D")
    aborts_before = sum(count(servers[n].metrics(), "abort_notices") for n in ("P1", "P2"))
    refused_before = {n: count(servers[n].metrics(), "refused_messages") for n in names}
    sabotage.set("slow_prefill", "unsigned_aborts" if notice == "unsigned" else "")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            prompts = random_prompts(seed=12, n=2)
            fleet.reference.update(zip(prompts, answers(servers["ref"].url, model, prompts)))
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
    assert all(a.startswith("<") or a == fleet.reference[p] for p, a in zip(prompts, got)), got
    router_serves_again(servers, model)
    assert compare(fleet, seed=4, n=4) == []


@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "kill_decode"])
def test_a_fault_fails_only_its_own_requests_and_every_page_comes_back(fleet, fault):
    """tests/sglang_pd.py: a_fault_fails_only_its_own_requests."""
    a_fault_fails_only_its_own_requests(fleet, fault)
