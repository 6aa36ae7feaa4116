"""How each test target (tests/tiers.py) spreads its modules over 2 workers
(pytest-xdist, ``-n 2 --dist loadscope``, tests/conftest.py). Most of a fleet test's
time one core waits on the other (a prefill forward, then a decode step), so a second
module fills it, within two limits:

- a module is one work unit (its fleet is a module-scoped fixture), except the modules
  that make network namespaces: their hosts' addresses are fixed
  (testing/emulated_hosts.py, netns_host.py), so they share one unit;
- two big fleets never run side by side: an SGLang fleet holds 3-6 servers of ~2.4 GB
  each (scheduler, tokenizer manager and detokenizer processes), and an SGLang fleet
  beside another, or beside the data-parallel vLLM fleet, filled a 24 GiB machine (both
  ran twice as slow, and a test failed); one beside vLLM's TP 2 engines peaked at 21 GB.

Within those, the heaviest unit goes first, so no long module is left alone at the end.
"""
from __future__ import annotations

import os
from typing import Dict, Iterable

from tiers import FULL_ONLY_SECONDS, GATE_SECONDS

NETNS_MODULES = {"test_decode_links.py", "test_demo.py", "test_late_writes.py", "test_partition.py",
                 "test_three_hosts.py"}
# test_three_hosts starts vLLM engines on three emulated hosts; test_vllm_mla three
# engines, one at TP 2: beside test_sglang_swa's late servers, the kernel's OOM killer
# ended one of its engines (a full pre-run on 2026-11-29, 23 GiB)
BIG_FLEETS = {"test_sglang_decode_radix.py", "test_sglang_mla.py", "test_sglang_pd.py",
              "test_sglang_pd_checks.py", "test_sglang_replicated_heads.py", "test_sglang_swa.py",
              "test_sglang_tp.py", "test_serving_load.py", "test_serving_proxy.py",
              "test_serving_restarts.py", "test_vllm_dp.py", "test_vllm_tp.py", "test_vllm_mla.py",
              "netns"}


def module_name(nodeid: str) -> str:
    return os.path.basename(nodeid.split("::")[0])


def work_unit(nodeid: str) -> str:
    name = module_name(nodeid)
    return "netns" if name in NETNS_MODULES else name


def unit_seconds(modules: Dict[str, float]) -> Dict[str, float]:
    """Recorded seconds by work unit (the netns modules add up to one unit)."""
    units: Dict[str, float] = {}
    for name, seconds in modules.items():
        unit = work_unit(name)
        units[unit] = units.get(unit, 0.0) + seconds
    return units


# Each unit's recorded seconds (tests/tiers.py): the heaviest goes first. The build
# checks compile on both cores and so start early, beside test_sglang_pd.py, whose tests
# mostly wait, rather than beside a fleet that computes (test_sglang_mla.py took 665 s
# beside test_npu_build.py and others, 498 s in an earlier run).
UNIT_SECONDS = unit_seconds({**GATE_SECONDS, **FULL_ONLY_SECONDS})


def make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModulesHeaviestFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

        def _big_fleet_elsewhere(self, node) -> bool:
            return any(unit in BIG_FLEETS and False in tests.values()
                       for other, units in self.assigned_work.items() if other is not node
                       for unit, tests in units.items())

        def _assign_work_unit(self, node):
            blocked = self._big_fleet_elsewhere(node)
            fits = [unit for unit in self.workqueue if not (blocked and unit in BIG_FLEETS)]
            if not fits:  # the node waits: a test ending elsewhere reschedules it
                return
            heaviest = max(fits, key=lambda unit: UNIT_SECONDS.get(unit, 0))
            self.workqueue.move_to_end(heaviest, last=False)
            super()._assign_work_unit(node)

        def mark_test_complete(self, node, item_index, duration=0):
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:
                if other is not node and not self._pending_of(self.assigned_work.get(other, {})):
                    self._reschedule(other)

    return ModulesHeaviestFirst(config, log)


def planned_seconds(units: Iterable[str], seconds: Dict[str, float], workers: int = 2) -> float:
    """The wall time of running ``units`` on ``workers`` by this scheduler's rules (the
    heaviest unit that fits goes next; no two big fleets side by side), each taking its
    recorded ``seconds``: what the budget check (tests/test_tiers.py) compares."""
    queue = sorted(units, key=lambda unit: -seconds.get(unit, 0.0))
    running: Dict[int, tuple] = {}  # worker -> (unit, end time)
    now = 0.0
    while queue or running:
        for worker in range(workers):
            if worker in running or not queue:
                continue
            big_elsewhere = any(unit in BIG_FLEETS for unit, _ in running.values())
            fits = [unit for unit in queue if not (big_elsewhere and unit in BIG_FLEETS)]
            if fits:
                unit = fits[0]
                queue.remove(unit)
                running[worker] = (unit, now + seconds.get(unit, 0.0))
        if not running:
            raise AssertionError(f"units left that no worker may take: {queue}")
        worker, (_, now) = min(running.items(), key=lambda item: item[1][1])
        del running[worker]
    return now
