#!/usr/bin/env bash
# SGLang for the SGLang plugin's tests, in its own environment (default .venv-sglang):
# SGLang 0.5.23 pins torch 2.14.1, the main environment torch 2.13.0. torch_kvops is
# installed there as a built copy of this tree (its extension compiled against torch
# 2.14.1), never the tree itself: the tree's in-place extension is the main
# environment's. `make test` runs this (through `make setup-sglang`) when sources change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SGLANG_VENV:-.venv-sglang}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  bash scripts/phase.sh "virtual environment $VENV" "$PYTHON" -m venv "$VENV"
fi
PY="$(cd "$VENV" && pwd)/bin/python"
"$PY" -m pip install -q --upgrade "pip>=23"
bash scripts/phase.sh "sglang 0.5.23 in $VENV (no deps)" \
  "$PY" -m pip install -q --no-deps "$(grep -E '^sglang==' requirements-sglang.txt)"
bash scripts/phase.sh "SGLang's requirements in $VENV (requirements-sglang.txt: torch 2.14.1, ~6 GB)" \
  "$PY" -m pip install -q -r requirements-sglang.txt
# torch 2.14.1 from PyPI is a CUDA build: with nvcc on PATH setup.py would compile the CUDA
# sources (no GPU here: torch's arch detection fails). The plugin's tests run on CPU.
# A copy of the tree, kept between runs with its build folder: an unchanged csrc/ is
# not compiled again (file times are kept), so a Python-only change installs in seconds.
SRC="build/sglang-src"
mkdir -p "$SRC"
rm -rf "$SRC/torch_kvops" "$SRC/csrc"
git ls-files -co --exclude-standard -- setup.py pyproject.toml README.md csrc torch_kvops \
  | tar -cf - -T - | tar -xf - -C "$SRC"
KVOPS_DISABLE_CUDA=1 MAX_JOBS=2 bash scripts/phase.sh \
  "torch_kvops built against $VENV's torch $("$PY" -c 'import torch; print(torch.__version__)') and installed there" \
  "$PY" -m pip install -q --no-build-isolation --no-deps "$SRC"
(cd / && "$PY" - <<'PY'
import importlib.metadata as md
import torch, sglang, torch_kvops
assert torch.__version__.startswith("2.14.1"), torch.__version__
assert "site-packages" in torch_kvops.__file__, torch_kvops.__file__
names = [ep.name for ep in md.entry_points(group="sglang.srt.plugins")]
assert "kvops" in names, f"the kvops plugin entry point is not installed: {names}"
print("[setup-sglang] sglang", sglang.__version__, "| torch", torch.__version__,
      "| torch_kvops", torch_kvops.build_info())
PY
)
touch "$VENV/.ready"
