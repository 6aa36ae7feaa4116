"""The test tiers (tests/tiers.py, docs/testing.md): every module declares a kind, the
seconds tables name every module once, the gate holds what it must, and the gate's
recorded time on 2 workers, set-up included, fits its budget, a check rather than a
memory. The negative controls: the whole suite in the gate exceeds the budget, and
pytest refuses to collect a module without a kind."""
import os
import subprocess
import sys
import tomllib

import pytest

from module_scheduler import BIG_FLEETS, planned_seconds, unit_seconds
from tiers import (BUDGET_SECONDS, FULL_ONLY_SECONDS, GATE_SECONDS, KINDS, MARKERS, SETUP_SECONDS,
                   markers, select, module_files)

pytestmark = [pytest.mark.unit]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def test_every_module_names_a_kind_and_only_declared_markers():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = {line.split(":")[0] for line in tomllib.load(f)["tool"]["pytest"]["ini_options"]["markers"]}
    assert declared == MARKERS
    for name in module_files():
        assert markers(name) & KINDS, f"{name} names no kind"
        assert markers(name) <= MARKERS, f"{name}: {markers(name) - MARKERS}"


def test_the_seconds_tables_name_every_module_once():
    assert not set(GATE_SECONDS) & set(FULL_ONLY_SECONDS)
    assert set(GATE_SECONDS) | set(FULL_ONLY_SECONDS) == set(module_files())


def test_the_gate_holds_every_unit_process_and_netns_module_and_one_fleet_per_engine():
    light = {name for name in module_files() if markers(name) & {"unit", "process", "netns"}}
    assert light <= set(GATE_SECONDS)
    fleets = {name: markers(name) for name in set(GATE_SECONDS) - light}
    assert all("fleet" in marks for marks in fleets.values()), fleets
    for engine in ("vllm", "sglang"):
        assert len([name for name, marks in fleets.items() if engine in marks]) == 1, (engine, fleets)
    # the tiers run what they say: the gate is its table, full is every module
    assert sorted(select("gate", False) + select("gate", True)) == sorted(GATE_SECONDS)
    assert sorted(select("full", False) + select("full", True)) == module_files()
    assert not [name for name in select("quick", False) + select("quick", True)
                if markers(name) & {"fleet", "netns", "build"}]


def gate_seconds(modules) -> float:
    """The gate's recorded wall time: set-up, the modules that share 2 workers on the
    suite's schedule, then the alone step."""
    shared = unit_seconds({name: s for name, s in modules.items() if "alone" not in markers(name)})
    alone = sum(s for name, s in modules.items() if "alone" in markers(name))
    return SETUP_SECONDS + planned_seconds(shared, shared) + alone


def test_the_gates_recorded_time_fits_its_budget():
    planned = gate_seconds(GATE_SECONDS)
    print(f"\n[tiers] the gate's recorded time: {planned:.0f} s of {BUDGET_SECONDS} s")
    assert planned <= BUDGET_SECONDS


def test_negative_control_the_whole_suite_in_the_gate_exceeds_the_budget():
    assert gate_seconds({**GATE_SECONDS, **FULL_ONLY_SECONDS}) > BUDGET_SECONDS


def test_planned_seconds_keeps_big_fleets_apart_and_fills_the_other_worker():
    big = sorted(unit for unit in BIG_FLEETS if unit != "netns")[:2]
    seconds = {big[0]: 100.0, big[1]: 100.0, "test_small.py": 50.0, "test_tiny.py": 40.0}
    # the two big fleets one after another; the small ones beside them
    assert planned_seconds(seconds, seconds) == 200.0
    light = {"a": 100.0, "b": 100.0, "c": 50.0}
    assert planned_seconds(light, light) == 150.0


@pytest.mark.parametrize("marked", [False, True])
def test_collection_refuses_a_module_without_a_kind(tmp_path, marked):
    """Seen red: ``pytest --collect-only`` on a module with no marker fails and names
    it; the control, the same module with ``pytest.mark.unit``, is collected."""
    for name in ("conftest.py", "tiers.py", "module_scheduler.py"):
        os.symlink(os.path.join(HERE, name), tmp_path / name)
    mark = "pytestmark = [pytest.mark.unit]\n" if marked else ""
    (tmp_path / "test_new.py").write_text(f"import pytest\n\n{mark}\n\ndef test_one():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-c", os.path.join(ROOT, "pyproject.toml"), "--rootdir", str(tmp_path),
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    if marked:
        assert run.returncode == 0, run.stdout + run.stderr
    else:
        assert run.returncode != 0
        assert "test modules without a kind marker: test_new.py" in run.stdout + run.stderr, run.stdout + run.stderr
