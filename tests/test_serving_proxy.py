"""P/D through our proxy, under load and faults: the fleet of tests/test_serving_load.py
(`vllm serve` API servers, 2 P, 2 D and a monolithic reference; tests/serving_fleet.py),
loaded by vLLM's own benchmark client (`vllm bench serve`, torch_kvops.serving.load)
through our proxy (concurrent and D-first dispatch). `make test-full` and `make
test-vllm` run it; the gate runs the vLLM router's path of the same fleet.

- Under load every answer equals the monolithic reference's (greedy, same prompts: the
  random dataset with the same seed) and D computed exactly one prompt token per
  request (D's `vllm:prompt_tokens_by_source{source="local_compute"}`); the negative
  control sends D no transfer parameters and sees D compute the prompts.
- Through our proxy, D first and concurrent, completions and chat, streamed or not:
  the reference's answers, D computing at most one block; requests spread over both
  P and both D.
- A slow D (its `begin` answers 3 s late) holds up no P step; the negative control
  (``no_detach``) waits.
- Faults under load: SIGKILL of a P (answered or failed within the lease, traffic moves
  to the other P, the restarted P takes traffic again; the negative control, a proxy
  that neither retries nor avoids the dead P, fails more than the in-flight requests),
  clients that disconnect (P and D abort them; the negative control, a proxy that
  aborts nothing upstream, sees D finish the cut requests).
- After every test all block pools are free and nothing runs (vLLM's /metrics).

One fleet for the module (its start-up is most of the cost); the tests run in order.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from typing import Dict, List, Tuple

import aiohttp
import pytest

from serving_fleet import (CONCURRENCY, FAULT_LOAD, HOLD_S, LEASE_S, Fleet, load_and_kill,
                           same_answers, started_fleet)
from torch_kvops.serving import prometheus
from torch_kvops.serving.model import random_prompt

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]

# 200 requests with prompts of 50-3000 tokens: most short, some long (the compute of
# 200 uniformly long prompts on 2 cores would dominate the suite, not the coverage)
PHASES = [dict(num_prompts=180, input_len=325, range_ratio=0.846, seed=1),  # 50-600
          dict(num_prompts=20, input_len=2500, range_ratio=0.2, seed=2)]  # 2000-3000
BLOCK = 32


@pytest.fixture(scope="module")
def fleet():
    with started_fleet() as fleet:
        yield fleet


def test_load_answers_equal_reference_and_decode_computes_one_token(fleet):
    before = {s: fleet.prompt_tokens(s) for s in ("local_compute", "external_kv_transfer")}
    requests = prompt_tokens = 0
    for phase in PHASES:
        ref = fleet.reference(**phase)
        got = fleet.load("proxy", **phase)
        requests += phase["num_prompts"]
        lens = got["input_lens"]
        prompt_tokens += sum(lens)
        assert min(lens) >= 50 and max(lens) <= 3000
        wrong = same_answers(got, ref)
        assert not wrong, f"{len(wrong)} answers differ from the reference: {wrong[:10]}"
        assert got["completed"] == phase["num_prompts"]
    # every request's KV came from P: D computed at most the last prompt token (vLLM
    # recomputes it to sample the first output token), never a block
    local = fleet.prompt_tokens("local_compute") - before["local_compute"]
    external = fleet.prompt_tokens("external_kv_transfer") - before["external_kv_transfer"]
    assert local <= requests, f"D computed {local} prompt tokens for {requests} requests"
    assert external + local == prompt_tokens, (external, local, prompt_tokens)
    fleet.wait_all_idle(30)


def _post(url: str, body: dict, stream: bool = False):
    """One request: the answer (a dict), or with ``stream`` the text of its
    server-sent events, chunks joined."""
    req = urllib.request.Request(url, json.dumps(dict(body, stream=stream)).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        if not stream:
            return json.loads(resp.read())
        text = []
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(text)


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("order", ["d-first", "concurrent"])
def test_proxy_completions_and_chat_streamed_or_not_equal_the_reference(fleet, order):
    """Our proxy in each dispatch order: completions and chat, streamed and not, give
    the reference's answers; D reports computing at most one block of each prompt."""
    front = fleet.url("proxy-d-first" if order == "d-first" else "proxy")
    rng = random.Random(21)
    prompts = [random_prompt(n, 1024, rng) for n in (40, 600)]  # 600: P prefills 2 chunks
    before = fleet.prompt_tokens("local_compute")
    requests = 0
    for path in ("/v1/completions", "/v1/chat/completions"):
        for prompt in prompts:
            body = {"model": fleet.model, "max_tokens": 6, "temperature": 0}
            body.update({"prompt": prompt} if path == "/v1/completions" else
                        {"messages": [{"role": "user", "content": prompt}]})
            want = _text(_post(fleet.url("ref") + path, body))
            got = _post(front + path, body)
            assert _text(got) == want, (order, path, len(prompt.split()))
            assert got["kv_transfer_params"]["kvops_local_prompt_tokens"] <= BLOCK, got["kv_transfer_params"]
            assert _post(front + path, body, stream=True) == want, (order, path, "stream")
            requests += 2
    local = fleet.prompt_tokens("local_compute") - before
    assert local <= BLOCK * requests, f"D computed {local} prompt tokens for {requests} requests"
    fleet.wait_all_idle(30)


def _upstream_requests(fleet: Fleet, front: str) -> Dict[str, float]:
    """Requests the proxy ``front`` sent so far to each P and D, by server name."""
    counts = prometheus.find(prometheus.fetch(fleet.url(front)), "kvops_proxy_upstream_requests_total")
    return {name: sum(v for k, v in counts.items() if fleet.url(name) in k)
            for name in ("P1", "P2", "D1", "D2")}


def test_requests_spread_over_both_prefill_and_decode_instances(fleet):
    before = _upstream_requests(fleet, "proxy-d-first")
    rng = random.Random(22)
    for _ in range(8):
        _post(fleet.url("proxy-d-first") + "/v1/completions",
              {"model": fleet.model, "prompt": random_prompt(100, 1024, rng), "max_tokens": 2})
    after = _upstream_requests(fleet, "proxy-d-first")
    assert all(after[n] > before[n] for n in after), (before, after)
    fleet.wait_all_idle(30)


def test_negative_control_without_transfer_decode_computes_the_prompts(fleet):
    """The same check fails when D gets no transfer parameters (it then prefills)."""
    phase = dict(num_prompts=8, input_len=300, range_ratio=0.5, seed=5)
    ref = fleet.reference(**phase)
    before = fleet.prompt_tokens("local_compute")
    got = fleet.load("proxy-nokv", **phase)
    assert not same_answers(got, ref)  # the answers are right: D computed them itself
    local = fleet.prompt_tokens("local_compute") - before
    assert local == sum(got["input_lens"]) > phase["num_prompts"]
    fleet.wait_all_idle(HOLD_S + 30)  # P held the blocks of 8 destinations that never came


SLOW_D_LOAD = dict(num_prompts=24, input_len=600, range_ratio=0.5, seed=5)  # 300-900


def test_a_slow_decode_holds_up_no_prefill_step(fleet):
    """D1 answers every ``begin`` 3 s late (``slow_begin``: its control thread stalls),
    under load through the proxy. P's lane to D1 waits; P's steps do not: no
    ``wait_for_save`` of either P lasts 2.5 s (vLLM's kvops_exposed_transfer_seconds);
    every answer equals the reference. D2's TTFT (vLLM's, on D2) is printed with the
    run's counters, not asserted: its spread on 2 loaded cores is wider than the
    effect. Negative control in the same run (``no_detach``, the sender waits for
    every peer of a step): P's steps wait for D1."""
    ref = fleet.reference(**SLOW_D_LOAD)
    runs = {}
    try:
        for case, modes in (("baseline", ()), ("slow_d", ("slow_begin",)),
                            ("no_detach", ("slow_begin", "no_detach"))):
            fleet.sabotage.set(*modes)
            before = _slow_d_counters(fleet)
            got = fleet.load("proxy", **SLOW_D_LOAD)
            wrong = same_answers(got, ref)
            assert not wrong, f"{case}: answers differ from the reference: {wrong}"
            after = _slow_d_counters(fleet)
            delta = {k: after[k] - before[k] for k in after}
            runs[case] = dict(delta, d2_mean_ttft=delta["d2_ttft_sum"] / max(delta["d2_requests"], 1))
            fleet.sabotage.set()
            fleet.wait_all_idle(90)
    finally:
        fleet.sabotage.set()
    print({case: {k: round(v, 3) for k, v in r.items()} for case, r in runs.items()})
    slow, control = runs["slow_d"], runs["no_detach"]
    assert control["p_steps_over_2_5_s"] >= 1, f"P's steps did not wait for D1: the control guards nothing: {runs}"
    assert slow["p_steps_over_2_5_s"] == 0, f"a P step waited for the slow D: {runs}"


def _slow_d_counters(fleet: Fleet) -> Dict[str, float]:
    """P's push steps that waited over 2.5 s after their forward, D2's requests and the
    sum of their TTFTs (vLLM's histograms, cumulative)."""
    p_over, p_counts = 0.0, dict.fromkeys(("peer_link_broken", "peer_connect_pending", "requests_failed"), 0.0)
    for p in ("P1", "P2"):
        samples = fleet.servers[p].metrics()
        p_over += (prometheus.total(samples, "vllm:kvops_exposed_transfer_seconds_count")
                   - prometheus.total(samples, "vllm:kvops_exposed_transfer_seconds_bucket", le="2.5"))
        for name in p_counts:
            p_counts[name] += prometheus.total(samples, f"vllm:kvops_{name}_total")
    d2 = fleet.servers["D2"].metrics()
    return {"p_steps_over_2_5_s": p_over, **{f"p_{k}": v for k, v in p_counts.items()},
            "d2_requests": prometheus.total(d2, "vllm:time_to_first_token_seconds_count"),
            "d2_ttft_sum": prometheus.total(d2, "vllm:time_to_first_token_seconds_sum"),
            "d2_over_1_s": prometheus.total(d2, "vllm:time_to_first_token_seconds_count")
            - prometheus.total(d2, "vllm:time_to_first_token_seconds_bucket", le="1.0"),
            "d2_over_2_5_s": prometheus.total(d2, "vllm:time_to_first_token_seconds_count")
            - prometheus.total(d2, "vllm:time_to_first_token_seconds_bucket", le="2.5")}


def test_sigkill_prefill_under_load(fleet):
    p2_before = fleet.counter("P2", "vllm:request_success_total")
    got, failed = load_and_kill(fleet, "P1", **FAULT_LOAD)
    # an in-flight request is answered (retried, or recomputed by D when its lease
    # ends) or fails; the later ones go to the other P
    assert len(failed) <= CONCURRENCY, f"{len(failed)} requests failed: {got['errors']}"
    assert max(got["latencies"]) < LEASE_S + 30, max(got["latencies"])  # none hangs
    assert fleet.counter("P2", "vllm:request_success_total") - p2_before > FAULT_LOAD["num_prompts"] / 2
    # the killed P restarts and takes traffic again
    fleet.servers.restart("P1")
    p1_after_restart = fleet.counter("P1", "vllm:request_success_total")
    phase = dict(num_prompts=16, input_len=200, range_ratio=0.5, seed=6)
    got = fleet.load("proxy", **phase)
    assert not same_answers(got, fleet.reference(**phase))
    assert fleet.counter("P1", "vllm:request_success_total") > p1_after_restart
    fleet.wait_all_idle(LEASE_S + HOLD_S + 30)


def test_negative_control_sigkill_prefill_behind_a_proxy_that_neither_retries_nor_avoids(fleet):
    """The bound above fails when the front end keeps choosing the dead P."""
    got, failed = load_and_kill(fleet, "P2", front="proxy-noretry", **FAULT_LOAD)
    print(f"\n[negative control] P2 killed behind a proxy without retries: {len(failed)} of "
          f"{FAULT_LOAD['num_prompts']} requests failed")
    assert len(failed) > CONCURRENCY, f"only {len(failed)} requests failed"
    fleet.servers.restart("P2")
    fleet.wait_all_idle(LEASE_S + HOLD_S + 30)


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, disconnect_after: int) -> str:
    """Stream one completion; with ``disconnect_after`` >= 0 close the connection after
    that many chunks (0: before the first byte). ``resp.close()`` shuts the socket at
    once: a response left to the context manager could be read to its end into the
    client's buffer (seen once: a cut request streamed all 200 tokens)."""
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        chunks = 0
        if disconnect_after == 0:
            resp.close()
            return "disconnected"
        async for _ in resp.content.iter_any():
            chunks += 1
            if chunks == disconnect_after:
                resp.close()
                return "disconnected"
    return "done"


def _cut_clients(fleet: Fleet, front: str, prompts: List[str], cut: Dict[int, int]
                 ) -> Tuple[List[str], int]:
    """Stream every prompt through ``front`` (at most CONCURRENCY at once); the clients
    in ``cut`` leave after that many chunks (0: before the first byte; they ask for 200
    tokens, the others for 4). Returns the outcomes and how many requests the decode
    servers finished (vLLM counts no abort in request_success) once every engine is
    idle with a free pool."""
    time.sleep(2.0)  # the API servers' counters of the previous test's last requests settle
    finished = {n: fleet.counter(n, "vllm:request_success_total", finished_reason="length")
                for n in ("D1", "D2")}
    url = f"{fleet.url(front)}/v1/completions"

    async def run() -> List[str]:
        sem = asyncio.Semaphore(CONCURRENCY)
        timeout = aiohttp.ClientTimeout(total=300)
        # force_close: no connection is kept for reuse, so a cut client's socket closes
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(force_close=True)) as session:
            async def one(i: int) -> str:
                async with sem:
                    body = {"model": fleet.model, "prompt": prompts[i], "stream": True,
                            "temperature": 0, "ignore_eos": True,
                            "max_tokens": 200 if i in cut else 4}
                    if cut.get(i) == 0:
                        # give the request time to reach P and D before it is dropped
                        task = asyncio.ensure_future(_stream(session, url, body, -1))
                        await asyncio.sleep(0.3)
                        task.cancel()
                        try:
                            await task
                        except asyncio.CancelledError:
                            return "disconnected"
                        return "done"
                    return await _stream(session, url, body, cut.get(i, -1))
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    outcomes = asyncio.run(run())
    # every engine ends idle with a free pool: nothing left decoding or holding blocks
    fleet.wait_all_idle(LEASE_S + HOLD_S + 30)
    time.sleep(2.0)
    done = sum(fleet.counter(n, "vllm:request_success_total", finished_reason="length") - v
               for n, v in finished.items())
    return outcomes, done


def test_client_disconnects_abort_on_prefill_and_decode(fleet):
    rng = random.Random(7)
    prompts = [random_prompt(rng.randint(200, 1500), 1024, rng) for _ in range(40)]
    # 10% of the clients: two before the first byte (P and D still working), two
    # mid-stream (D decoding a long answer)
    cut = {3: 0, 17: 0, 9: 2, 29: 2}
    disconnects = fleet.counter("proxy", "kvops_proxy_client_disconnects_total")
    outcomes, done = _cut_clients(fleet, "proxy", prompts, cut)
    assert outcomes.count("done") == len(prompts) - len(cut)
    # D finished exactly the requests whose clients stayed: the four cut ones were
    # aborted before their 200 tokens
    assert done == len(prompts) - len(cut), done
    assert fleet.counter("proxy", "kvops_proxy_client_disconnects_total") - disconnects == len(cut)


def test_negative_control_a_proxy_that_aborts_nothing_lets_decode_finish_cut_requests(fleet):
    """The check above fails when the client's leaving aborts nothing upstream."""
    rng = random.Random(8)
    prompts = [random_prompt(rng.randint(200, 600), 1024, rng) for _ in range(4)]
    outcomes, done = _cut_clients(fleet, "proxy-noabort", prompts, {1: 2, 3: 2})
    assert outcomes.count("disconnected") == 2
    assert done == len(prompts), done  # the two cut requests decoded their 200 tokens
