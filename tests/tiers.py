"""The test tiers (docs/testing.md): which modules each `make` target runs, the gate's
modules with their recorded seconds, and the gate's time budget.

Every test module says what it is with markers (``pytestmark = [pytest.mark....]``
after its imports; the markers are declared in pyproject.toml):

- its kind, at least one: ``unit`` (one process, no engine, no network namespace),
  ``process`` (real processes: Mooncake peers, SGLang's own Python, compilers; no
  engine server), ``netns`` (makes network namespaces: needs root, ``ip`` and ``tc``),
  ``fleet`` (starts engines: ``vllm serve`` or SGLang servers, or in-process vLLM
  engines);
- what it needs or does besides: ``vllm`` (vLLM, in the main environment), ``sglang``
  (the SGLang adapter; with ``process`` or ``fleet`` it runs SGLang's own environment,
  ``.venv-sglang``), ``build`` (compiles the package: wheel, CUDA and NPU link checks,
  minutes of both cores), ``gpu`` (a CUDA device: tests_gpu/), ``alone`` (bounds a
  speed: runs after the others, nothing beside it).

conftest.py refuses to collect a module without a kind. Run as a script, this file
prints the test files of a tier for the Makefile (``python tests/tiers.py gate`` for
the modules that share the 2 workers, ``--alone`` for those that run after them).
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Callable, Dict, FrozenSet, List

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = frozenset({"unit", "process", "netns", "fleet"})
MARKERS = KINDS | {"vllm", "sglang", "build", "gpu", "alone"}

# The gate (`make test`, what CI runs): every unit, process and netns module, and per
# engine the one fleet that shows its main path end to end. Seconds: each module's
# wall time (its `[module time]` line) in the pre-run of 2026-12-07 (a fresh clone's
# `CI=true bash .ci/run` on a 2-core AMD EPYC without AMX, 23 GiB: set-up 525 s, the
# 2-worker step 1,545 s, the alone step 198 s, 2,267 s in all), the alone modules'
# from its alone step. They order the schedule (heaviest first) and keep the budget
# (tests/test_tiers.py); a module added to the gate adds its seconds here.
GATE_SECONDS: Dict[str, float] = {
    "test_ci_builds.py": 588,
    "test_sglang_pd.py": 411,  # 2P1D behind sglang-router: answers, a corruption control, SIGKILL of D
    "test_serving_load.py": 368,  # vllm serve P/D behind vllm-router under vLLM's load client, SIGKILL of D
    "test_npu_build.py": 227,
    "test_connector.py": 179,
    "test_hostile_consumer.py": 177,
    "test_three_hosts.py": 176,
    "test_fence.py": 155,
    "test_peer_churn.py": 110,
    "test_integrity.py": 79,
    "test_sglang_plugin.py": 78,
    "test_tp_reshard.py": 60,
    "test_control_trust.py": 70,
    "test_admission.py": 40,
    "test_paged_llama.py": 40,
    "test_partition.py": 35,
    "test_late_writes.py": 44,  # 36 s in make test-full on 2026-12-07, then 3 s timeouts in one test
    "test_demo.py": 28,
    "test_layer_windows.py": 28,
    "test_mooncake_ports.py": 27,
    "test_exposure.py": 27,
    "test_side_channel.py": 30,
    "test_sglang_decode_peers.py": 26,
    "test_mooncake_log.py": 19,
    "test_vllm_late_binding_units.py": 18,
    "test_decode_links.py": 16,
    "test_block_spaces.py": 15,
    "test_soak.py": 12,
    "test_tiers.py": 11,
    "test_compile.py": 10,
    "test_vllm_integration_units.py": 9,
    "test_vllm_kv_layout.py": 6,
    "test_copy_policy.py": 3,
    "test_dp_prefill.py": 2,
    "test_ops.py": 2,
    "test_house.py": 2,
    "test_packaging.py": 2,
    "test_block_digests.py": 1,
    "test_sglang_units.py": 1,
    "test_vllm_cudagraph_mode.py": 0,
    "test_vllm_metrics.py": 0,
    "test_vllm_mla_plan.py": 0,
    "test_vllm_tp_plan.py": 0,
    "test_serving_report.py": 0,
    "test_addresses.py": 0,
    "test_offload_units.py": 0,
    "test_sglang_ttft_report.py": 0,
    # the alone step
    "test_transport_mooncake.py": 48,
    "test_emulated_link.py": 24,
    "test_slow_consumer.py": 88,
    "test_slow_scatter.py": 34,
}

# The rest of `make test-full` (order of the schedule only): wall times of the same
# day's run of these modules on 2 workers (same machine; test_vllm_connector.py's and
# test_vllm_preemption.py's from stop 55's CI log: the first failed to start its engines
# in that run, the second's line counted the wait of its last test for the session's
# end, xdist holding a worker's last test until it knows the next).
FULL_ONLY_SECONDS: Dict[str, float] = {
    "test_sglang_pd_checks.py": 943,
    "test_sglang_mla.py": 685,
    "test_sglang_tp.py": 490,
    "test_sglang_swa.py": 470,
    "test_serving_restarts.py": 414,
    "test_serving_proxy.py": 380,
    "test_sglang_replicated_heads.py": 354,
    "test_sglang_decode_radix.py": 240,
    "test_serving_harness.py": 183,
    "test_vllm_offload_mla.py": 167,
    "test_vllm_fence.py": 162,
    "test_vllm_dp.py": 138,
    "test_vllm_connector.py": 120,
    "test_vllm_late_binding.py": 118,
    "test_vllm_negative_controls.py": 106,
    "test_vllm_tp.py": 90,
    "test_vllm_mla.py": 66,
    "test_vllm_preemption.py": 60,
    "test_vllm_offload.py": 42,
}

# A fresh clone's set-up before the first test (both environments side by side, the
# extension, vLLM): 525 s in the same pre-run, with pip's cache warm; CI downloads from
# the registry. And the gate's limit: CI allows 90 minutes, the gate takes at most half,
# so a slower machine or a new module still fits.
SETUP_SECONDS = 600
BUDGET_SECONDS = 45 * 60

TIERS: Dict[str, Callable[[FrozenSet[str], str], bool]] = {
    # what a contributor runs every few minutes: no fleet, no namespace, no compiler,
    # only the main environment
    "quick": lambda marks, name: (bool(marks & {"unit", "process"}) and "build" not in marks
                                  and not {"sglang", "process"} <= marks),
    "gate": lambda marks, name: name in GATE_SECONDS,
    "vllm": lambda marks, name: "vllm" in marks,
    "sglang": lambda marks, name: "sglang" in marks,
    "full": lambda marks, name: True,
}


def module_files() -> List[str]:
    return sorted(f for f in os.listdir(HERE) if f.startswith("test_") and f.endswith(".py"))


def markers(name: str) -> FrozenSet[str]:
    """The markers a module's ``pytestmark`` names (read from its source: nothing is
    imported, so a tier is chosen without SGLang or vLLM at hand)."""
    with open(os.path.join(HERE, name)) as f:
        tree = ast.parse(f.read(), name)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "pytestmark"):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            found = set()
            for value in values:
                if not (isinstance(value, ast.Attribute) and ast.unparse(value.value) == "pytest.mark"):
                    raise ValueError(f"{name}: pytestmark names {ast.unparse(value)}: "
                                     "write pytest.mark.<marker> entries only")
                found.add(value.attr)
            return frozenset(found)
    return frozenset()


def select(tier: str, alone: bool) -> List[str]:
    chosen, picked = TIERS[tier], []
    for name in module_files():
        marks = markers(name)
        if chosen(marks, name) and ("alone" in marks) == alone:
            picked.append(name)
    return picked


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tier", choices=sorted(TIERS))
    parser.add_argument("--alone", action="store_true",
                        help="the tier's modules that run alone, after the others")
    args = parser.parse_args(argv)
    missing = [name for name in module_files() if not markers(name) & KINDS]
    if missing:
        print(f"modules without a kind marker ({', '.join(sorted(KINDS))}): {missing}", file=sys.stderr)
        return 2
    print(" ".join(os.path.join("tests", name) for name in select(args.tier, args.alone)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
