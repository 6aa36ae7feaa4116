"""Packaging and the benchmark's entry point. The full wheel check (build, install into a
clean venv, use the installed package from outside the tree) is `make wheel-check`."""
import json
import os
import sys
import tomllib

import pytest

from torch_kvops.bench import __main__ as bench_main

pytestmark = [pytest.mark.unit]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_directory_is_a_package():
    """setup.py finds packages by their __init__.py: a directory of modules without one
    would be left out of the wheel (as torch_kvops/bench once was)."""
    missing = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "torch_kvops")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if any(f.endswith(".py") for f in filenames) and "__init__.py" not in filenames:
            missing.append(os.path.relpath(dirpath, ROOT))
    assert not missing, f"no __init__.py (left out of the wheel): {missing}"


def test_pyproject_declares_build_requirements_and_extras():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    build = project["build-system"]
    assert build["build-backend"] == "setuptools.build_meta"
    assert any(r.replace(" ", "").startswith("torch==") for r in build["requires"]), \
        "an isolated build must not pull an unpinned torch"
    extras = project["project"]["optional-dependencies"]
    assert "matplotlib" in " ".join(extras["plot"])
    # Mooncake pinned to the tested range (its acknowledged TCP framing, 0.3.13 on),
    # which holds the version the suite runs with (requirements-dev.txt)
    assert extras["mooncake"] == ["mooncake-transfer-engine-non-cuda>=0.3.13,<0.4"]
    assert extras["mooncake-cuda"] == ["mooncake-transfer-engine>=0.3.13,<0.4"]
    from packaging.requirements import Requirement
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        tested = [Requirement(line.split("#")[0].strip()) for line in f
                  if line.startswith("mooncake-transfer-engine-non-cuda==")]
    assert len(tested) == 1
    assert next(iter(tested[0].specifier)).version in Requirement(extras["mooncake"][0]).specifier
    assert extras["vllm"] == ["vllm"]


def _fake_overlap_run(quick):
    return {"traces": {}, "fake": True}


def test_bench_writes_json_first_and_succeeds_without_matplotlib(tmp_path, monkeypatch, capsys):
    import torch_kvops.demo as demo

    monkeypatch.setattr(bench_main.overlap_bench, "run", _fake_overlap_run)
    monkeypatch.setattr(demo, "print_report", lambda result: None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it now fails
    real_find_spec = bench_main.importlib.util.find_spec
    monkeypatch.setattr(bench_main.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    out, png = tmp_path / "r.json", tmp_path / "t.png"
    assert bench_main.main(["--only", "overlap", "--out", str(out), "--timeline", str(png)]) == 0
    assert json.loads(out.read_text())["overlap"] == {"traces": {}, "fake": True}
    assert not png.exists()
    assert "matplotlib is not installed" in capsys.readouterr().out


def test_bench_writes_json_before_drawing(tmp_path, monkeypatch):
    """A failure while drawing must not lose the numbers."""
    import torch_kvops.demo as demo
    monkeypatch.setattr(bench_main.overlap_bench, "run", _fake_overlap_run)
    monkeypatch.setattr(demo, "print_report", lambda result: None)

    def broken_plot(result, path):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(bench_main.overlap_bench, "plot_timeline", broken_plot)
    monkeypatch.setattr(bench_main.importlib.util, "find_spec", lambda name: object())
    out = tmp_path / "r.json"
    with pytest.raises(RuntimeError, match="drawing failed"):
        bench_main.main(["--only", "overlap", "--out", str(out), "--timeline", str(tmp_path / "t.png")])
    assert "overlap" in json.loads(out.read_text())


def test_bench_rejects_an_unknown_benchmark(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main.main(["--only", "opps"])
    assert exc.value.code == 2
    assert "unknown benchmark" in capsys.readouterr().err


def test_bench_redraws_the_timeline_from_saved_results(tmp_path):
    # matplotlib comes with requirements-dev.txt (the `plot` extra for users).
    saved = os.path.join(ROOT, "tests", "data", "overlap-results.json")
    out = tmp_path / "again.png"
    assert bench_main.main(["--redraw", saved, "--timeline", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(SystemExit):  # a results file without overlap results
        bench_main.main(["--redraw", _write(tmp_path / "empty.json", {"machine": {}})])


def _write(path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)
