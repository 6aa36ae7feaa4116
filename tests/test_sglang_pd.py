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
import random
import subprocess
import time
import urllib.error
import urllib.request
from typing import Dict, List, Tuple

import pytest

from torch_kvops.serving import prometheus
from torch_kvops.serving.model import random_prompt
from torch_kvops.serving.servers import Servers
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec, sglang_python

from serving_fleet import workspace
from sglang_sabotage import serving_env

MAX_TOKENS = 16
PAGE_SIZE = 16  # tokens per page (SGLang's default is 1)
CHUNK = 256  # P1's --chunked-prefill-size; prompts are 50-800 tokens
# D's lease: a room that waits in a prefill queue longer outlives the wait only by the
# prefill servers' notices of the rooms they owe (every OWED_NOTICE_S). It is also P's
# write lease, so P must never stall that long between two layers: 6 s was too short
# on 2 cores while a restarted D warmed up beside four servers (a CI run's log). The
# renewal tests shorten the lease of new rooms on D (sglang_sabotage's short_lease)
LEASE_S = 20.0
OWED_NOTICE_S = 1.0
SETTLE_S = 180.0  # a fault's pages come back within: lease + fence + SGLang's timeouts


# the plugin's own tests first: they need no fleet (and run before it starts)


def _in_sglang(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sglang_python(), "-c", code], capture_output=True, text=True,
                          timeout=300, cwd="/")


def test_the_plugin_adds_the_backend_and_checks_the_sglang_it_runs_in():
    done = _in_sglang(
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.disaggregation import utils\n"
        "from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES as c\n"
        "from torch_kvops.integrations.sglang import conn\n"
        "b = utils.TransferBackend('kvops')\n"
        "assert 'kvops' in c and b != utils.TransferBackend.MOONCAKE\n"
        "got = {t.value: utils.get_kv_class(b, t).__name__ for t in utils.KVClassType}\n"
        "print(sorted(got.items()))\n"
        "assert utils.get_kv_class(utils.TransferBackend.MOONCAKE, utils.KVClassType.SENDER)"
        ".__name__ == 'MooncakeKVSender'\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("[('bootstrap_server', 'KvopsKVBootstrapServer'), ('kvargs', 'KVArgs'), "
            "('manager', 'KvopsKVManager'), ('receiver', 'KvopsKVReceiver'), "
            "('sender', 'KvopsKVSender')]") in done.stdout


def test_a_changed_sglang_internal_fails_loudly_at_start_up():
    done = _in_sglang(
        "from sglang.srt.disaggregation.common import conn\n"
        "def send(self, pages, state=None): pass\n"
        "conn.CommonKVSender.send = send\n"
        "from torch_kvops.integrations.sglang import internals\n"
        "internals.check()\n")
    assert done.returncode != 0
    assert "CommonKVSender.send('pages', 'state') differs" in done.stderr, done.stderr[-2000:]


def test_what_the_backend_does_not_move_yet_is_refused_at_start_up():
    """An MLA model (one latent buffer per layer) or tensor parallelism: a clear error
    when the manager starts, never a transfer that moves the wrong buffers."""
    done = _in_sglang(
        "from types import SimpleNamespace as NS\n"
        "from torch_kvops.integrations.sglang.manager import check_supported\n"
        "check_supported(NS(), NS(device='cpu', tp_size=1), False)\n"
        "for args, server, mla in ((NS(), NS(device='cpu', tp_size=1), True),\n"
        "                          (NS(), NS(device='cpu', tp_size=2), False)):\n"
        "    try:\n"
        "        check_supported(args, server, mla)\n"
        "    except NotImplementedError as exc:\n"
        "        print(exc)\n")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "the kvops SGLang backend does not support MLA models (latent KV pools, DeepSeek) yet",
        "the kvops SGLang backend does not support tensor parallelism yet"], done.stdout


def _key_file(tmp: str, name: str) -> str:
    path = os.path.join(tmp, name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(os.urandom(32).hex())
    return path


@pytest.fixture(scope="module")
def fleet():
    with workspace("kvops-sglang") as (tmp, model, log_dir, sabotage):
        # SGLang's own waits for a peer that never comes (300 s each by default): a
        # prefill server whose decode server died gives its rooms up after 60 s
        env = dict(serving_env(os.path.join(tmp, "plugin")),
                   SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="60",
                   SGLANG_DISAGGREGATION_WAITING_TIMEOUT="120",
                   # D never gives a prefill server up for missed heartbeats: a restarted
                   # one is found only by its moved ranks (prefill_restarts.py), as one
                   # restarted between two heartbeats must be
                   SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="1000",
                   KVOPS_FLEET_KEY_FILE=_key_file(tmp, "fleet.key"),
                   KVOPS_SGLANG_CONFIG=json.dumps({"owed_notice_s": OWED_NOTICE_S, "connector": {
                       "lease_s": LEASE_S, "integrity_check": "mac"}}))
        same = dict(env=env, page_size=PAGE_SIZE)
        # health checks every 5 s, an open circuit retried after 10 s (60 s each by
        # default): a restarted server is back in the rotation within seconds (each
        # check may take SglangRouterSpec's health_check_timeout_s)
        checks = ["--health-check-interval-secs", "5", "--cb-timeout-duration-secs", "10"]
        with Servers(log_dir) as servers:
            p1 = servers.add(SglangServerSpec("P1", model, role="prefill",
                                              extra_args=["--chunked-prefill-size", str(CHUNK)], **same))
            p2 = servers.add(SglangServerSpec("P2", model, role="prefill", **same))
            d = servers.add(SglangServerSpec("D", model, role="decode", **same))
            servers.add(SglangServerSpec("ref", model, role="monolithic", **same))
            servers.add(SglangRouterSpec("router", [p1, p2], [d], extra_args=checks))
            # started by its test only: P3, a prefill server with another key (it waits
            # 20 s for a destination that never comes), behind a router of its own that
            # tries each request once (its rooms fail at D's lease; a retry waits again)
            p3 = servers.add(SglangServerSpec("P3", model, role="prefill", page_size=PAGE_SIZE, env=dict(
                env, KVOPS_FLEET_KEY_FILE=_key_file(tmp, "another.key"),
                SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="20")))
            servers.add(SglangRouterSpec("foreign", [p3], [d], extra_args=checks + ["--disable-retries"]))
            servers.start(["P1", "P2", "D", "ref"], 600)
            servers.start(["router"], 600)  # it needs the servers' ports
            yield servers, model, sabotage
            problems = servers.stop_all()
            assert not problems, problems


def _complete(url: str, model: str, prompt: str, timeout: float = 300.0) -> str:
    """The answer's text, or what went wrong in <...> (which differs from any answer)."""
    # ignore_eos: the test model may sample its end token early (seen once: 2 tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return f"<HTTP {exc.code}: {exc.read()[:300]!r}>"
    except OSError as exc:  # refused, reset, or this client gave up (timeout)
        return f"<no answer: {exc!r}>"
    choice = answer["choices"][0]
    if choice["finish_reason"] != "length":
        return f"<finished by {choice['finish_reason']!r}: {answer}>"
    return choice["text"]


def _answers(url: str, model: str, prompts: List[str], timeout: float = 300.0) -> List[str]:
    if not prompts:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(url, model, p, timeout), prompts))


def _prompts(seed: int, n: int) -> List[str]:
    rng = random.Random(seed)
    return [random_prompt(rng.randint(50, 800), 1024, rng) for _ in range(n)]


_reference: Dict[str, str] = {}


def _compare(fleet, seed: int, n: int = 8) -> List[int]:
    """Indices of the prompts whose answer through the router differs from the
    monolithic server's (n prompts sent at once)."""
    return _compare_answers(fleet, seed, n)[0]


def _compare_answers(fleet, seed: int, n: int = 8) -> Tuple[List[int], List[str]]:
    """(indices of the answers that differ from the monolithic server's, the answers)."""
    servers, model, _ = fleet
    prompts = _prompts(seed, n)
    missing = [p for p in prompts if p not in _reference]
    _reference.update(zip(missing, _answers(servers["ref"].url, model, missing)))
    assert not [a for a in _reference.values() if a.startswith("<")], _reference
    got = _answers(servers["router"].url, model, prompts)
    differ = [i for i, (p, a) in enumerate(zip(prompts, got)) if a != _reference[p]]
    print(f"\n[sglang] seed {seed}: {len(differ)} of {n} answers differ: "
          + "; ".join(got[i][:120] for i in differ[:3]))
    return differ, got


def _count(samples, name: str, **labels) -> float:
    return prometheus.total(samples, f"kvops_sglang_{name}_total", **labels)


def test_router_answers_equal_the_monolithic_server_and_prefill_pushes_layer_by_layer(fleet):
    servers = fleet[0]
    assert _compare(fleet, seed=1, n=16) == []
    assert _compare(fleet, seed=2, n=16) == []  # the pages of the first load are reused
    p1, p2, d = (prometheus.fetch(servers[name].url) for name in ("P1", "P2", "D"))
    # the router spread the rooms over both prefill servers; each reached D whole
    rooms = [_count(p, "rooms", label="success") for p in (p1, p2)]
    assert min(rooms) >= 8 and sum(rooms) >= 32, rooms
    assert _count(d, "rooms", label="success") >= 32
    # D computed no prompt token: SGLang's own prefill counter on D stays at 0 (P's counts)
    prefilled = [prometheus.total(s, "sglang:prefill_effective_tokens_total", mode="input")
                 for s in (p1, p2, d)]
    assert prefilled[2] == 0 and min(prefilled[:2]) > 0, prefilled
    assert not any(_count(s, "rooms", label="failed") for s in (p1, p2, d))
    # rooms waited in the prefill queues; their leases were renewed while they did
    assert _count(d, "lease_renewals") > 0
    # every chunk left in its forward, layer by layer (SGLang starts a prefill once its
    # destination is known); none waited for the forward's end
    for p in (p1, p2):
        assert _count(p, "chunks", label="after_forward") == 0
    # P1's rooms left in more chunks than rooms (prefill chunked by 256 tokens)
    assert _count(p1, "chunks", label="forward") > rooms[0] + 8
    layers = sum(_count(p, "layers") for p in (p1, p2))
    early = sum(_count(p, "layers_landed_during_forward") for p in (p1, p2))
    print(f"\n[sglang] {early:.0f} of {layers:.0f} pushed layers landed before their forward ended")
    assert layers > 0 and early > 0


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
    prompts = _prompts(seed={"misplace": 16, "drop": 13, "drop_layer": 14}[mode], n=8)
    _reference.update(zip(prompts, _answers(servers["ref"].url, model, prompts)))
    before = _count(servers["D"].metrics(), CAUGHT_BY[mode])
    sabotage.set(mode)
    try:
        got = _answers(servers["router"].url, model, prompts)
    finally:
        sabotage.set()
    caught = _count(servers["D"].metrics(), CAUGHT_BY[mode]) - before
    wrong = [a for p, a in zip(prompts, got) if not a.startswith("<") and a != _reference[p]]
    print(f"\n[sglang] checked, {mode}: {caught:.0f} rooms failed D's check (the router retries "
          f"a failed room as a new one); {len([a for a in got if a.startswith('<')])} of 8 "
          f"requests failed, {len(wrong)} wrong")
    assert not wrong, wrong
    assert caught >= 8, f"{mode}: D's check failed only {caught:.0f} rooms"
    _pages_come_back(servers, ["P1", "P2", "D"])
    _router_serves_again(servers, model)  # D's failures opened the router's circuit for it
    assert _compare(fleet, seed=4, n=4) == []


def test_a_prefill_server_with_another_fleet_key_moves_nothing(fleet):
    """P3 holds another key than D: each refuses the other's messages (D's registration
    and destinations at P3; nothing of P3's reaches D's rooms), so every request
    through P3's router fails (none is answered wrong, D decodes from no KV of P3's),
    D's pages come back, and the fleet answers right."""
    servers, model, _ = fleet
    servers.start(["P3"])
    servers.start(["foreign"])
    try:
        _router_ready(servers["foreign"])
        prompts = _prompts(seed=15, n=2)
        got = _answers(servers["foreign"].url, model, prompts)
        refused = _count(servers["P3"].metrics(), "refused_messages")
        print(f"\n[sglang] another key: {refused:.0f} messages of D refused at P3; answers "
              f"{[a[:160] for a in got]}")
        assert all(a.startswith("<") for a in got), got
        assert refused >= 2, "P3 took D's messages"  # a registration and a room's destination
        assert _count(servers["P3"].metrics(), "rooms", label="success") == 0
        _pages_come_back(servers, ["P3", "D"])
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
    prompts = _prompts(seed={"owed_notices": 9, "no_renewal": 8}[renewals], n=12)
    _reference.update(zip(prompts, _answers(servers["ref"].url, model, prompts)))
    failed_before = _count(servers["D"].metrics(), "rooms", label="failed")
    renewed_before = _count(servers["D"].metrics(), "lease_renewals")
    sabotage.set("short_lease", "slow_prefill", "no_renewal" if renewals == "no_renewal" else "")
    try:
        got = _answers(servers["router"].url, model, prompts)
    finally:
        sabotage.set()
    d = servers["D"].metrics()
    failed = _count(d, "rooms", label="failed") - failed_before
    renewed = _count(d, "lease_renewals") - renewed_before
    print(f"\n[sglang] {renewals}: {failed:.0f} rooms failed on D (12 requests; the router "
          f"retries a failed room as a new one), {renewed:.0f} leases renewed; "
          f"{len([a for a in got if a.startswith('<')])} requests failed")
    assert not [a for p, a in zip(prompts, got) if not a.startswith("<") and a != _reference[p]]
    if renewals == "owed_notices":
        assert failed == 0 and renewed > 0, (failed, renewed)
    else:
        assert renewed == 0
        assert failed >= 1, "every room reached D within its lease: the control shows nothing"
    _pages_come_back(servers, ["P1", "P2", "D"])
    _router_serves_again(servers, model)  # failed rooms may have opened the router's circuit for D
    assert _compare(fleet, seed=4, n=4) == []  # and the fleet is whole again


def _used_tokens(servers, names) -> Dict[str, float]:
    return {n: prometheus.total(servers[n].metrics(), "sglang:kv_used_tokens") for n in names}


def _pages_come_back(servers, names: List[str]) -> float:
    """Seconds until no server of ``names`` holds a KV page of a request."""
    start = time.monotonic()
    while True:
        used = _used_tokens(servers, names)
        if not any(used.values()):
            return time.monotonic() - start
        if time.monotonic() - start > SETTLE_S:
            raise AssertionError(f"KV pages still held {SETTLE_S:.0f} s after the fault: {used}")
        time.sleep(1.0)


def _when_pushing(server, timeout: float = 120.0) -> None:
    """Return once the prefill ``server`` pushed a chunk more than when called."""
    base, deadline = _count(server.metrics(), "chunks"), time.monotonic() + timeout
    while _count(server.metrics(), "chunks") == base:
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name} pushed nothing in {timeout:.0f} s")
        time.sleep(0.05)


def _router_ready(router, timeout: float = 60.0) -> None:
    """Wait until sglang-router's /readiness answers 200: it has healthy prefill and
    decode workers (its /health answers as soon as it listens, with none)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{router.url}/readiness", timeout=5.0):
                return
        except OSError as exc:  # HTTPError (503: no workers yet) or not listening
            if time.monotonic() > deadline:
                raise AssertionError(f"{router.name} not ready within {timeout:.0f} s: {exc}")
        time.sleep(0.5)


def _router_serves_again(servers, model: str, timeout: float = 120.0) -> None:
    """Wait until the router has a server of each role in its rotation again (its
    health checks passed: until then it answers 503)."""
    deadline = time.monotonic() + timeout
    while (answer := _complete(servers["router"].url, model, "a b c", 60.0)).startswith("<HTTP 503"):
        if time.monotonic() > deadline:
            raise AssertionError(f"the router still refuses requests {timeout:.0f} s after the "
                                 f"restart: {answer[:300]}")
        time.sleep(2.0)


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
    _router_serves_again(servers, model)
    names = ("P1", "P2", "D")
    aborts_before = sum(_count(servers[n].metrics(), "abort_notices") for n in ("P1", "P2"))
    refused_before = {n: _count(servers[n].metrics(), "refused_messages") for n in names}
    sabotage.set("slow_prefill", "unsigned_aborts" if notice == "unsigned" else "")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            prompts = _prompts(seed=12, n=2)
            _reference.update(zip(prompts, _answers(servers["ref"].url, model, prompts)))
            load = pool.submit(_answers, servers["router"].url, model, prompts, 120.0)
            time.sleep(1.0)  # D holds both rooms, their prefills wait
            abort = urllib.request.Request(f"{servers['D'].url}/abort_request", method="POST",
                                           data=json.dumps({"abort_all": True}).encode(),
                                           headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(abort, timeout=30.0) as resp:
                assert resp.status == 200
            got = load.result()
    finally:
        sabotage.set()
    settled_s = _pages_come_back(servers, list(names))
    aborts = sum(_count(servers[n].metrics(), "abort_notices") for n in ("P1", "P2")) - aborts_before
    refused = {n: _count(servers[n].metrics(), "refused_messages") - refused_before[n] for n in names}
    print(f"\n[sglang] aborted on D, notice {notice}: answers {[a[:80] for a in got]}; abort notices "
          f"taken by the prefill servers {aborts:.0f}; messages refused {refused}; pages back "
          f"{settled_s:.0f} s after")
    if notice == "unsigned":
        assert aborts == 0 and refused["P1"] + refused["P2"] >= 1, (aborts, refused)
    else:
        assert aborts >= 1 and not any(refused.values()), (aborts, refused)
    # each right or an error (sglang-router may retry an aborted request as a new room)
    assert all(a.startswith("<") or a == _reference[p] for p, a in zip(prompts, got)), got
    _router_serves_again(servers, model)
    assert _compare(fleet, seed=4, n=4) == []


FAULTS = {"kill_prefill": "P1", "kill_decode": "D", "client_disconnects": None}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_fails_only_its_own_requests_and_every_page_comes_back(fleet, fault):
    """A server killed while P1 pushes (SIGKILL of its process group), or clients that
    hang up after 1 s: the fault fails rooms (or requests), no answer is wrong (each is
    right or an error), every page on the servers left comes back to SGLang, and the
    fleet answers right again (the killed server restarted on its ports)."""
    servers, model, _ = fleet
    _router_serves_again(servers, model)  # (a fresh fleet's router may hold requests at first)
    victim = FAULTS[fault]
    prompts = _prompts(seed=10 + list(FAULTS).index(fault), n=8)
    missing = [p for p in prompts if p not in _reference]
    _reference.update(zip(missing, _answers(servers["ref"].url, model, missing)))
    rooms_failed = {n: _count(servers[n].metrics(), "rooms", label="failed") for n in ("P1", "P2", "D")}
    refused_before = {n: _count(servers[n].metrics(), "refused_messages") for n in ("P1", "P2", "D")}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        load = pool.submit(_answers, servers["router"].url, model, prompts,
                           1.0 if victim is None else 240.0)
        if victim is not None:
            _when_pushing(servers["P1"])
            servers.kill(victim)
        got = load.result()
    failed = [i for i, a in enumerate(got) if a.startswith("<")]
    wrong = [i for i, (p, a) in enumerate(zip(prompts, got)) if i not in failed and a != _reference[p]]
    left = [n for n in ("P1", "P2", "D") if n != victim]
    settled_s = _pages_come_back(servers, left)
    # the rooms the fault failed on the servers left (sglang-router retries a request
    # whose transfer failed, so its client may never see the fault)
    hit = {n: _count(servers[n].metrics(), "rooms", label="failed") - rooms_failed[n] for n in left}
    refused = {n: _count(servers[n].metrics(), "refused_messages") - refused_before[n] for n in left}
    print(f"\n[sglang] {fault}: {len(failed)} of 8 requests failed, {len(wrong)} wrong; rooms failed "
          f"{hit}; pages of {left} back {settled_s:.0f} s after the load; messages refused "
          f"{refused}; first error: {[got[i][:160] for i in failed[:1]]}")
    assert not wrong, [got[i] for i in wrong]
    assert not any(refused.values()), "a server of the fleet refused a message of the fleet"
    assert failed or any(hit.values()), "the fault hit no request: nothing was shown"
    if victim is not None:
        servers.restart(victim, 600)
        _router_serves_again(servers, model)
    # the fleet is whole again; a restarted prefill server is back in the router's
    # rotation (its health checks pass) and pushes its share of rooms
    # new prompts each time (a seen prefix is routed where it went before), for up to
    # 90 s: sglang-router takes the restarted server back after its health checks pass
    deadline = time.monotonic() + 90.0
    for attempt in range(100):
        assert _compare(fleet, seed=40 + attempt, n=4) == []
        served = _count(servers["P1"].metrics(), "rooms", label="success")
        if victim != "P1" or served or time.monotonic() > deadline:
            break
        time.sleep(3.0)
    print(f"[sglang] after the fault P1 pushed {served:.0f} rooms ({attempt + 1} loads)")
    assert served >= 1
