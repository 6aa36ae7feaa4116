"""The `vllm serve` fleet tests/test_serving_load.py runs: 2 P and 2 D with
KvopsLayerwiseConnector, a monolithic reference, vLLM's router and our proxy (and the
negative controls' fronts), with helpers to load it through vLLM's benchmark client and
read its Prometheus metrics. A test helper, like vllm_sabotage.py, never product code.

The engines run with vLLM's message-queue busy-spin cut to 2 ms (``shm_busy_loop_s``,
the setting vllm-project/vllm#52814 proposes; serving/shm_spin/): five engines that
each spin a core for 1 s after every step overload 2 cores (docs/benchmarks.md, "Where
the serving stalls went"). The P's load tests/vllm_sabotage.py as a vLLM plugin, idle
until a test names a mode in ``Fleet.sabotage``; so does D1 (D2 never does).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import tempfile
import time
from typing import Dict, Iterator, List, Tuple

from torch_kvops.serving import prometheus
from torch_kvops.serving.load import LoadClient, random_load_args
from torch_kvops.serving.model import write_serving_model
from torch_kvops.serving.servers import ProxySpec, RouterSpec, Servers, ServerSpec

from vllm_sabotage import Switch, serving_env

LEASE_S = 15.0  # D: a transfer whose P died is recomputed after this
FENCE_DRAIN_S = 5.0  # D: a killed P's blocks are kept this long (docs/connector.md, "The fence")
HOLD_S = 8.0  # P: blocks held for a destination that never comes
CONCURRENCY = 8
FAULT_LOAD = dict(num_prompts=40, input_len=900, range_ratio=0.9, seed=3)  # 90-1710 tokens
SPIN_S = 0.002  # vLLM's message-queue busy-spin after each step (1 s as shipped)
ENGINES = ("P1", "P2", "D1", "D2", "ref")


class Fleet:
    def __init__(self, servers: Servers, model: str, client: LoadClient, sabotage: Switch) -> None:
        self.servers, self.model, self.client, self.sabotage = servers, model, client, sabotage
        self._reference: Dict[Tuple, dict] = {}

    def url(self, name: str) -> str:
        return self.servers[name].url

    def load(self, front: str, output_len: int = 4, **phase) -> dict:
        args = random_load_args(model=self.model, output_len=output_len,
                                max_concurrency=CONCURRENCY, **phase)
        return self.client.run(self.url(front), args)

    def reference(self, **phase) -> dict:
        key = tuple(sorted(phase.items()))
        if key not in self._reference:
            self._reference[key] = self.load("ref", **phase)
            assert not any(self._reference[key]["errors"]), "the reference server failed requests"
        return self._reference[key]

    def prompt_tokens(self, source: str) -> float:
        """Prompt tokens of the decode servers so far, by source: ``local_compute`` (D
        computed them) or ``external_kv_transfer`` (they came from P)."""
        return sum(prometheus.prompt_tokens(self.servers[d].metrics(), source) for d in ("D1", "D2"))

    def counter(self, name: str, metric: str, **labels: str) -> float:
        return prometheus.total(self.servers[name].metrics(), metric, **labels)

    def wait_all_idle(self, timeout: float) -> Dict[str, dict]:
        """Wait until every running engine is idle with its block pool free (and P
        holds nothing); return the last states for the assertion message."""
        deadline = time.monotonic() + timeout
        while True:
            states = {}
            for n in (n for n in ENGINES if self.servers[n].alive()):
                samples = self.servers[n].metrics()
                states[n] = dict(prometheus.engine_state(samples),
                                 held=prometheus.total(samples, "vllm:kvops_held_requests"))
            if all(s["running"] == 0 and s["waiting"] == 0 and s["kv_cache_usage"] == 0
                   and s["held"] == 0 for s in states.values()):
                return states
            if time.monotonic() > deadline:
                raise AssertionError(f"engines not idle with free block pools after {timeout} s: "
                                     f"{states}")
            time.sleep(0.5)


@contextlib.contextmanager
def workspace(prefix: str, **model) -> Iterator[Tuple[str, str, str, Switch]]:
    """(a temporary folder, the serving model in it (``model``: keyword arguments of
    ``write_serving_model``), a log folder, the sabotage switch) for a fleet's test; the
    folder and the switch go at the end, the logs stay for a failure's reader (the
    harness prints their folder). Engines started inside inherit the switch's file name."""
    tmp = tempfile.TemporaryDirectory(prefix=f"{prefix}-")
    model_dir = os.path.join(tmp.name, "model")
    write_serving_model(model_dir, **model)
    sabotage = Switch(tmp.name)
    try:
        yield tmp.name, model_dir, tempfile.mkdtemp(prefix=f"{prefix}-logs-"), sabotage
    finally:
        sabotage.close()
        tmp.cleanup()


@contextlib.contextmanager
def started_fleet() -> Iterator[Fleet]:
    """Start the fleet, yield it, stop every process."""
    with workspace("kvops-serving-load") as (tmp, model, log_dir, sabotage):
        with Servers(log_dir) as servers:
            common = dict(threads=1, shm_busy_loop_s=SPIN_S)
            prefill = [servers.add(ServerSpec(
                f"P{i}", model, role="prefill", env=serving_env(os.path.join(tmp, "plugin"),
                                                                "prefill"),
                kv_connector_extra_config={"hold_for_decode_s": HOLD_S}, **common)) for i in (1, 2)]
            # D1 loads the sabotage plugin too (a slow D); D2 never does
            decode = [servers.add(ServerSpec(f"D{i}", model, role="decode", lease_s=LEASE_S,
                                             kv_connector_extra_config={"connector": {
                                                 "fence_drain_s": FENCE_DRAIN_S}},
                                             env=serving_env(os.path.join(tmp, "plugin"), "decode")
                                             if i == 1 else {}, **common))
                      for i in (1, 2)]
            servers.add(ServerSpec("ref", model, role="monolithic", **common))
            servers.add(RouterSpec("router", prefill, decode))
            for order in ("concurrent", "d-first"):
                servers.add(ProxySpec("proxy" if order == "concurrent" else f"proxy-{order}",
                                      prefill, decode, order=order,
                                      extra_args=["--down-s", "3", "--retries", "3"]))
            # negative controls: D gets no transfer parameters; no retry, and a failed P is
            # not avoided; a client's leaving aborts nothing upstream
            servers.add(ProxySpec("proxy-nokv", prefill, decode, order="concurrent",
                                  extra_args=["--no-decode-params"]))
            servers.add(ProxySpec("proxy-noretry", prefill, decode, order="concurrent",
                                  extra_args=["--retries", "0", "--down-s", "0"]))
            servers.add(ProxySpec("proxy-noabort", prefill, decode, order="concurrent",
                                  extra_args=["--no-abort-on-disconnect"]))
            servers.start_all(900)
            client = LoadClient(os.path.join(log_dir, "load.log"))
            try:
                yield Fleet(servers, model, client, sabotage)
            finally:
                client.close()
                problems = servers.stop_all()
                assert not problems, problems


def same_answers(got: dict, ref: dict) -> List[int]:
    """Indices of requests whose answer differs from the reference (errors included)."""
    assert got["input_lens"] == ref["input_lens"], "the client sent other prompts"
    return [i for i, (a, b, e) in enumerate(zip(got["generated_texts"], ref["generated_texts"],
                                                got["errors"])) if e or a != b]


def load_and_kill(fleet: Fleet, victim: str, front: str = "proxy", pushes_in_flight: bool = False,
                  sabotage: Tuple[str, ...] = (), **phase) -> Tuple[dict, List[int]]:
    """Run ``phase`` through ``front``, SIGKILL ``victim`` once it finished 3 requests;
    return the load's result and the indices of the failed requests, after checking
    that every answer that came back equals the reference. ``pushes_in_flight``: P's
    push steps start 1.5 s late from just before the kill for 2 s (``slow``), so that
    pushes to a dying D are certainly under way when it dies. ``sabotage``: modes
    set on the P's for the whole load."""
    ref = fleet.reference(**phase)
    base = fleet.counter(victim, "vllm:request_success_total")
    fleet.sabotage.set(*sabotage)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(fleet.load, front, **phase)
        deadline = time.monotonic() + 120
        while fleet.counter(victim, "vllm:request_success_total") - base < 3:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{victim} finished fewer than 3 requests in 120 s; {front}: "
                    f"{prometheus.find(fleet.servers[front].metrics(), 'kvops_proxy')}")
            time.sleep(0.2)
        if pushes_in_flight:
            fleet.sabotage.set(*sabotage, "slow")
            time.sleep(0.5)
        fleet.servers.kill(victim)
        if pushes_in_flight:
            time.sleep(2.0)
            fleet.sabotage.set(*sabotage)
        got = future.result(timeout=600)
    wrong = [i for i in same_answers(got, ref) if not got["errors"][i]]
    assert not wrong, f"answers differ from the reference: {wrong}"
    return got, [i for i, e in enumerate(got["errors"]) if e]
