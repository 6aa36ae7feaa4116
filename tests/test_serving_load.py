"""P/D as users serve it, the gate's vLLM fleet: `vllm serve` API servers (2 P, 2 D and a
monolithic reference; tests/serving_fleet.py) behind vLLM's router (`vllm-router
--vllm-pd-disaggregation --kv-connector mooncake`: P first) and our proxy, loaded by
vLLM's own benchmark client (`vllm bench serve`, torch_kvops.serving.load).

- Behind vllm-router every answer equals the reference and its KV came from P (late
  binding: P pushes when D's destination arrives after P's answer): D computed at most
  the last prompt token of each request (D's
  `vllm:prompt_tokens_by_source{source="local_compute"}`). The negative control
  switches late binding off on the P's (``no_late_binding``): D recomputes.
- A fault under load: SIGKILL of a D (answered or failed within the lease, the other D
  serves, the restarted D serves again, and P releases every block it held); the
  negative control, P's release path broken with ``no_release``, keeps blocks.
- After every test all block pools are free and nothing runs (vLLM's /metrics).

The rest of this fleet's checks (load through our proxy, dispatch orders, a slow D,
SIGKILL of a P, clients that disconnect) are tests/test_serving_proxy.py's, in
`make test-full` and `make test-vllm`. One fleet for the module (its start-up is most
of the cost); the tests run in order.
"""
from __future__ import annotations

import pytest

from serving_fleet import (CONCURRENCY, FAULT_LOAD, HOLD_S, LEASE_S, Fleet, load_and_kill,
                           same_answers, started_fleet)

pytestmark = [pytest.mark.fleet, pytest.mark.vllm]


@pytest.fixture(scope="module")
def fleet():
    with started_fleet() as fleet:
        yield fleet


ROUTER_LOAD = dict(num_prompts=40, input_len=1000, range_ratio=0.95, seed=11)  # 50-1950


def test_vllm_router_p_first_moves_every_prompt_from_prefill(fleet):
    """vLLM's router as users run it: P first (max_tokens=1), then D with P's
    bootstrap address; our P binds D's destination after its answer and pushes."""
    ref = fleet.reference(**ROUTER_LOAD)
    before = {s: fleet.prompt_tokens(s) for s in ("local_compute", "external_kv_transfer")}
    held_before = sum(fleet.counter(p, "vllm:kvops_holds_pushed_total") for p in ("P1", "P2"))
    got = fleet.load("router", **ROUTER_LOAD)
    wrong = same_answers(got, ref)
    if wrong:
        again = fleet.load("ref", **ROUTER_LOAD)  # is the reference itself stable there?
        raise AssertionError(f"{len(wrong)} answers differ from the reference: " + "; ".join(
            f"#{i} ({got['input_lens'][i]} tokens) router {got['generated_texts'][i]!r} "
            f"error {got['errors'][i]!r} ref {ref['generated_texts'][i]!r} "
            f"ref again {again['generated_texts'][i]!r}" for i in wrong[:5]))
    local = fleet.prompt_tokens("local_compute") - before["local_compute"]
    external = fleet.prompt_tokens("external_kv_transfer") - before["external_kv_transfer"]
    assert local <= ROUTER_LOAD["num_prompts"], f"D computed {local} prompt tokens"
    assert external + local == sum(got["input_lens"])
    held_pushed = sum(fleet.counter(p, "vllm:kvops_holds_pushed_total") for p in ("P1", "P2")) - held_before
    assert held_pushed == ROUTER_LOAD["num_prompts"]  # every destination came after P finished
    fleet.wait_all_idle(30)


def test_vllm_router_negative_control_without_late_binding_decode_recomputes(fleet):
    """The same router with late binding switched off on both P's: P prefills without
    a destination (it waits for none), and D recomputes every prompt."""
    phase = dict(num_prompts=4, input_len=400, range_ratio=0.5, seed=12)
    ref = fleet.reference(**phase)
    before = fleet.prompt_tokens("local_compute")
    fleet.sabotage.set("no_late_binding")
    try:
        got = fleet.load("router", **phase)
    finally:
        fleet.sabotage.set()
    assert not same_answers(got, ref)  # right answers, but D computed them itself
    local = fleet.prompt_tokens("local_compute") - before
    assert local == sum(got["input_lens"]), (local, got["input_lens"])
    fleet.wait_all_idle(LEASE_S + 30)


def _failed_pushes(fleet: Fleet) -> float:
    return sum(fleet.counter(p, "vllm:kvops_requests_failed_total") for p in ("P1", "P2"))


def test_sigkill_decode_under_load_frees_prefill_blocks(fleet):
    d2_before = fleet.counter("D2", "vllm:request_success_total")
    failed_before = _failed_pushes(fleet)
    got, failed = load_and_kill(fleet, "D1", pushes_in_flight=True, **FAULT_LOAD)
    # pushes to D1 were under way when it died: P had blocks to release
    assert _failed_pushes(fleet) > failed_before
    assert len(failed) <= CONCURRENCY, f"{len(failed)} requests failed: {got['errors']}"
    assert max(got["latencies"]) < LEASE_S + 30, max(got["latencies"])
    # the proxy retried around the dead D before the first byte: the other D served
    assert fleet.counter("D2", "vllm:request_success_total") - d2_before > FAULT_LOAD["num_prompts"] / 2
    # P releases every block it held or pushed for D1's requests (push failures and
    # holds end within their bounds)
    fleet.wait_all_idle(LEASE_S + HOLD_S + 30)
    fleet.servers.restart("D1")  # and the restarted D takes traffic again
    d1_after_restart = fleet.counter("D1", "vllm:request_success_total")
    phase = dict(num_prompts=16, input_len=200, range_ratio=0.5, seed=7)
    got = fleet.load("proxy", **phase)
    assert not same_answers(got, fleet.reference(**phase))
    assert fleet.counter("D1", "vllm:request_success_total") > d1_after_restart
    fleet.wait_all_idle(30)


def test_negative_control_a_prefill_that_releases_nothing_keeps_blocks_after_a_decode_dies(fleet):
    """The pool check of the D kill above fails when P's release path is broken
    (``no_release``: failed pushes and released holds never reported). Last in the
    module: the leaked blocks stay leaked, and D2 stays dead."""
    try:
        got, failed = load_and_kill(fleet, "D2", pushes_in_flight=True, sabotage=("no_release",),
                                     **FAULT_LOAD)
        with pytest.raises(AssertionError, match="not idle with free block pools") as leaked:
            fleet.wait_all_idle(LEASE_S + HOLD_S + 30)
    finally:
        fleet.sabotage.set()
    print(f"\n[negative control] D2 killed, P releasing nothing: {leaked.value}")
