#!/usr/bin/env bash
# Builds the wheel, installs it into a clean virtual environment and uses the installed
# package, from a directory outside the source tree, as a user would:
#   * torch_kvops is imported from site-packages (not from this checkout),
#   * every package of the source tree is in the wheel and imports,
#   * an op runs, the connector imports,
#   * `python -m torch_kvops.bench --help`, `python -m torch_kvops.demo --help`,
#     `python -m torch_kvops.serving.pd_compare --help` and `python -m torch_kvops.bench.pd_sweep --help` work
#     (without matplotlib, which only the `plot` extra installs).
#
# The wheel is built with the dev venv's torch (--no-build-isolation): an isolated build
# would install torch again just to compile against it. The clean venv gets
# torch==2.13.0 (the pin the wheel carries) and the `mooncake` extra.
#
# Environment: VENV (default .venv), KVOPS_WHEEL_KEEP=1 keeps the work directory.
set -euo pipefail

START=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"

log() { echo "check_wheel: $*"; }
trap 'echo "check_wheel: FAILED: command at line $LINENO exited with status $?: $BASH_COMMAND" >&2' ERR

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvops-wheel.XXXXXX")
if [ "${KVOPS_WHEEL_KEEP:-0}" != "1" ]; then
  trap 'rm -rf "$WORK"' EXIT
fi

log "building the wheel"
# setuptools builds in build/ (the compiled objects there are reused), but files left in
# build/lib* by an earlier build would go into the wheel even if the tree no longer has them.
rm -rf build/lib.*
MAX_JOBS="${MAX_JOBS:-2}" "$PY" -m pip wheel . --no-build-isolation --no-deps -q -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/torch_kvops-*.whl)
log "built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB)"

log "installing it into a clean venv"
"$PY" -m venv "$WORK/venv"
CLEAN="$WORK/venv/bin/python"
"$CLEAN" -m pip install -q "torch==2.13.0" "${WHEEL}[mooncake]"

# Every package directory of the source tree, as dotted names, for the import check.
PACKAGES=$(cd "$ROOT" && find torch_kvops -name '*.py' -not -path '*/__pycache__/*' \
  -exec dirname {} \; | sort -u | tr / .)

mkdir -p "$WORK/run"
cd "$WORK/run"  # nothing of the checkout on sys.path
log "using the installed package from $PWD"
"$CLEAN" - $PACKAGES <<'PY'
import importlib
import importlib.util
import os
import sys
import sysconfig

import torch
import torch_kvops

site = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
where = os.path.realpath(torch_kvops.__file__)
assert any(where.startswith(s + os.sep) for s in site), f"torch_kvops imported from {where}, not site-packages"
# Packages that need an optional extra (not installed here): shipped, and failing to
# import only for want of that extra.
# (Subpackages included: find_spec would import their parent, so look for the file.)
NEEDS_EXTRA = {"torch_kvops.integrations.vllm": "vllm"}
for name in sys.argv[1:]:
    extra = next((e for pkg, e in NEEDS_EXTRA.items() if name == pkg or name.startswith(pkg + ".")), None)
    if extra is not None and importlib.util.find_spec(extra) is None:
        init = os.path.join(os.path.dirname(where), *name.split(".")[1:], "__init__.py")
        assert os.path.exists(init), name
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            assert exc.name == extra, (name, exc)
        else:
            raise AssertionError(f"{name} imported without {extra}")
        continue
    module = importlib.import_module(name)
    assert os.path.realpath(module.__file__).startswith(os.path.dirname(where)), (name, module.__file__)

src = [torch.randn(8, 2, 4) for _ in range(2)]
dst = [torch.zeros(8, 2, 4) for _ in range(2)]
torch.ops.kvops.swap_blocks_batch(src, dst, torch.tensor([[1, 3], [5, 0]]))
assert torch.equal(dst[0][3], src[0][1]) and torch.equal(dst[1][0], src[1][5])

from torch_kvops import ConnectorConfig, LayerwiseConnector, MooncakeTransport  # noqa: F401
import mooncake.engine  # noqa: F401  (the extra installed it)

print(f"check_wheel: torch_kvops {where}, {len(sys.argv) - 1} packages, op ok, connector ok")
PY
"$CLEAN" -m torch_kvops.bench --help > bench-help.txt
grep -q -- "--quick" bench-help.txt
"$CLEAN" -m torch_kvops.demo --help > demo-help.txt
grep -q -- "--prompt-len" demo-help.txt
# the P/D comparison and its sweep run from the package, not from examples/
"$CLEAN" -m torch_kvops.serving.pd_compare --help > compare-help.txt
grep -q -- "--prompt-lens" compare-help.txt
"$CLEAN" -m torch_kvops.bench.pd_sweep --help > sweep-help.txt
grep -q -- "--rates" sweep-help.txt
log "passed in $((SECONDS - START)) s"
