"""What the SGLang fleet tests share (tests/test_sglang_pd.py, test_sglang_mla.py,
test_sglang_tp.py):
the fleet's environment (its key, the integrity check, SGLang's timeouts), requests as
clients send them, the fleet's counters, and waits for a fault to settle."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import time
import urllib.error
import urllib.request
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from torch_kvops.serving import prometheus
from torch_kvops.serving.model import random_prompt
from torch_kvops.serving.sglang import SglangRouterSpec, SglangServerSpec

from sglang_sabotage import serving_env

MAX_TOKENS = 16
PAGE_SIZE = 16  # tokens per page (SGLang's default is 1)
# D's lease: a room that waits in a prefill queue longer outlives the wait only by the
# prefill servers' notices of the rooms they owe (every OWED_NOTICE_S). It is also P's
# write lease, so P must never stall that long between two layers: 6 s was too short
# on 2 cores while a restarted D warmed up beside four servers (a CI run's log). The
# renewal tests shorten the lease of new rooms on D (sglang_sabotage's short_lease)
LEASE_S = 20.0
OWED_NOTICE_S = 1.0
SETTLE_S = 180.0  # a fault's pages come back within: lease + fence + SGLang's timeouts
# sglang-router's health checks every 5 s, an open circuit retried after 10 s (60 s
# each by default): a restarted server is back in the rotation within seconds (each
# check may take SglangRouterSpec's health_check_timeout_s)
ROUTER_CHECKS = ["--health-check-interval-secs", "5", "--cb-timeout-duration-secs", "10"]
TP2 = ["--tp-size", "2"]
# of the layers a prefill pushed in its forwards, the share that must land before their
# forward ended: 47-100% did in runs here (67 of 144 in the SWA fleet of stop 51's CI
# pre-run, 2 shared cores); pushed only as the forward ends (no hook after the KV
# writes), 3-6 of 84-88 did in the MLA fleet
LANDED_IN_FORWARD = 0.25


def fleet_env(tmp: str, *standins: str, **settings) -> Dict[str, str]:
    """The environment of every server of a test fleet: the test plugins (``standins``:
    as ``sglang_sabotage.serving_env``), the fleet key (a file in ``tmp``), D's ``mac``
    integrity check and lease, SGLang's waits, and more of the backend's ``settings``."""
    # SGLang's own waits for a peer that never comes (300 s each by default): a
    # prefill server whose decode server died gives its rooms up after 60 s
    return dict(serving_env(os.path.join(tmp, "plugin"), *standins),
                SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="60",
                SGLANG_DISAGGREGATION_WAITING_TIMEOUT="120",
                # D never gives a prefill server up for missed heartbeats: a restarted
                # one is found only by its moved ranks (prefill_restarts.py), as one
                # restarted between two heartbeats must be
                SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="1000",
                KVOPS_FLEET_KEY_FILE=key_file(tmp, "fleet.key"),
                KVOPS_SGLANG_CONFIG=json.dumps({"owed_notice_s": OWED_NOTICE_S, "connector": {
                    "lease_s": LEASE_S, "integrity_check": "mac"}, **settings}))


@contextlib.contextmanager
def serving(servers, names: List[str]) -> Iterator[None]:
    """Start the servers ``names``, then the router (it needs their ports); at the end
    stop every process of the fleet and fail on any that ended badly."""
    servers.start(names, 600)
    servers.start(["router"], 600)
    yield
    problems = servers.stop_all()
    assert not problems, problems


def key_file(tmp: str, name: str) -> str:
    path = os.path.join(tmp, name)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(os.urandom(32).hex())
    return path


def complete(url: str, model: str, prompt: str, timeout: float = 300.0) -> str:
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


def answers(url: str, model: str, prompts: List[str], timeout: float = 300.0) -> List[str]:
    if not prompts:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, model, p, timeout), prompts))


def random_prompts(seed: int, n: int) -> List[str]:
    rng = random.Random(seed)
    return [random_prompt(rng.randint(50, 800), 1024, rng) for _ in range(n)]


def differ_from_reference(servers, model: str, seed: int, n: int = 8, tag: str = "sglang",
                          reference: Optional[Dict[str, str]] = None,
                          router: str = "router") -> Tuple[List[int], List[str]]:
    """(indices of the answers of ``router`` that differ from the monolithic server's
    (``ref``), the router's answers) for ``n`` prompts sent at once. ``reference``:
    the monolithic server's answers by prompt, kept across calls (only the prompts it
    lacks are asked)."""
    reference = {} if reference is None else reference
    prompts = random_prompts(seed, n)
    missing = [p for p in prompts if p not in reference]
    reference.update(zip(missing, answers(servers["ref"].url, model, missing)))
    assert not [a for a in reference.values() if a.startswith("<")], reference
    got = answers(servers[router].url, model, prompts)
    differ = [i for i, (p, a) in enumerate(zip(prompts, got)) if a != reference[p]]
    print(f"\n[{tag}] seed {seed}: {len(differ)} of {n} answers differ: "
          + "; ".join(got[i][:120] for i in differ[:3]))
    return differ, got


def sabotage_changes_the_answers(sabotage, modes: Sequence[str],
                                 differ: Callable[[], Tuple[List[int], List[str]]]) -> List[int]:
    """A negative control: with the sabotage ``modes`` on, at least 6 of the 8 answers
    of ``differ()`` (:func:`differ_from_reference` of prompts of its own: pages left by
    an earlier run of the same prompts would hold the right KV) differ from the
    reference's, at least 3 of them answers rather than errors; the indices that differ."""
    sabotage.set(*modes)
    try:
        differ_at, got = differ()
    finally:
        sabotage.set()
    assert len(differ_at) >= 6, f"{modes}: only prompts {differ_at} of 8 answered differently"
    assert len([i for i in differ_at if not got[i].startswith("<")]) >= 3, got
    return differ_at


def add_tp2_servers(servers, model: str, env: Dict[str, str], chunk: int) -> Tuple[object, object]:
    """P (chunks of ``chunk`` tokens), D and the monolithic reference ("ref") at TP 2,
    each rank bound to one core, and the router between P and D; (P, D)."""
    tp2 = dict(env=dict(env, SGLANG_CPU_OMP_THREADS_BIND="0|1"), page_size=PAGE_SIZE)
    p = servers.add(SglangServerSpec("P", model, role="prefill",
                                     extra_args=TP2 + ["--chunked-prefill-size", str(chunk)], **tp2))
    d = servers.add(SglangServerSpec("D", model, role="decode", extra_args=TP2, **tp2))
    servers.add(SglangServerSpec("ref", model, role="monolithic", extra_args=TP2, **tp2))
    servers.add(SglangRouterSpec("router", [p], [d], extra_args=ROUTER_CHECKS))
    return p, d


def rooms_of_a_load(servers, model: str, seed: int, n: int, router: str, prefill: str, decode: str,
                    tag: str) -> Dict[str, float]:
    """Rooms each of ``prefill`` and ``decode`` ended in a load of ``n`` prompts through
    ``router``, whose answers equal the reference's; none failed."""
    names = (prefill, decode)
    before = {name: servers[name].metrics() for name in names}
    assert differ_from_reference(servers, model, seed, n, tag, router=router)[0] == []
    after = {name: servers[name].metrics() for name in names}
    ended = {name: count(after[name], "rooms", label="success") - count(before[name], "rooms", label="success")
             for name in names}
    failed = {name: count(after[name], "rooms", label="failed") - count(before[name], "rooms", label="failed")
              for name in names}
    print(f"\n[{tag}] {prefill} -> {decode}: rooms ended {ended}, failed {failed}")
    assert not any(failed.values()), failed
    return ended


def count(samples, name: str, **labels) -> float:
    return prometheus.total(samples, f"kvops_sglang_{name}_total", **labels)



def used_tokens(servers, names) -> Dict[str, float]:
    return {n: prometheus.total(servers[n].metrics(), "sglang:kv_used_tokens") for n in names}


def pages_come_back(servers, names: List[str]) -> float:
    """Seconds until no server of ``names`` holds a KV page of a request."""
    start = time.monotonic()
    while True:
        used = used_tokens(servers, names)
        if not any(used.values()):
            return time.monotonic() - start
        if time.monotonic() - start > SETTLE_S:
            raise AssertionError(f"KV pages still held {SETTLE_S:.0f} s after the fault: {used}")
        time.sleep(1.0)



def router_ready(router, timeout: float = 60.0) -> None:
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


def router_serves_again(servers, model: str, timeout: float = 120.0, router: str = "router") -> None:
    """Wait until the router answers a request again: a server of each role is in its
    rotation (its health checks passed: until then it answers 503) and took a request
    without an error (a server that was frozen may fail its first ones, and the
    router's circuit for it opens again)."""
    deadline = time.monotonic() + timeout
    while (answer := complete(servers[router].url, model, "a b c", 60.0)).startswith("<"):
        if time.monotonic() > deadline:
            raise AssertionError(f"the router still refuses requests {timeout:.0f} s after the "
                                 f"restart: {answer[:300]}")
        time.sleep(2.0)
