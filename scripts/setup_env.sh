#!/usr/bin/env bash
# Fresh-machine set-up for `make test` / `make demo`: system libraries Mooncake needs,
# a virtual environment with torch 2.13.0 (CPU) and the test/demo dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

need_libs=()
for lib in libibverbs.so.1 libnuma.so.1; do
  ldconfig -p | grep -q "$lib" || need_libs+=("$lib")
done
if [ "${#need_libs[@]}" -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  bash scripts/phase.sh "Debian packages libibverbs1 libnuma1 (Mooncake needs ${need_libs[*]})" \
    bash -c "$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 libnuma1"
fi

if [ ! -x "$VENV/bin/python" ]; then
  bash scripts/phase.sh "virtual environment $VENV" "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade "pip>=23"
bash scripts/phase.sh "torch 2.13.0 (CPU) in $VENV" "$VENV/bin/python" -m pip install -q "torch==2.13.0"
bash scripts/phase.sh "test and demo requirements (requirements-dev.txt: Mooncake, pytest...)" \
  "$VENV/bin/python" -m pip install -q -r requirements-dev.txt
# The package is used from the source tree (extension built in place).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$PWD" > "$SITE/torch_kvops-src.pth"
"$VENV/bin/python" -c "import torch, mooncake.engine; print('[setup] torch', torch.__version__, '| mooncake ok')"
touch "$VENV/.ready"
