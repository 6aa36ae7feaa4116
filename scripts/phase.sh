#!/usr/bin/env bash
# One phase of set-up, said as it goes: a line when it starts, its time when it ends.
#   bash scripts/phase.sh NAME COMMAND [ARGS...]
# Exits with the command's status (a failure says so, with its time).
set -uo pipefail
name="$1"
shift
start=$(date +%s)
echo "[setup] $name ..."
"$@"
status=$?
if [ "$status" -eq 0 ]; then
  echo "[setup] $name: done in $(( $(date +%s) - start )) s"
else
  echo "[setup] $name: FAILED (exit $status) after $(( $(date +%s) - start )) s" >&2
fi
exit "$status"
