# Shared by scripts/check_cuda_build.sh and scripts/check_npu_build.sh (sourced, not run):
# logging, the Python the extension is built for, a bounded parallel compile whose
# failures and warnings are reported per source, and a link whose messages are filtered.
#
# The sourcing script sets CHECK_NAME (the log prefix) and ROOT before sourcing this file.

log() { echo "$CHECK_NAME: $*"; }
die() { echo "$CHECK_NAME: FAILED: $*" >&2; exit 1; }
trap 'echo "$CHECK_NAME: FAILED: command at line $LINENO exited with status $?: $BASH_COMMAND" >&2' ERR

require_tools() {  # require_tools TOOL...
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || die "'$tool' is not installed"
  done
}

# Sets PY (the interpreter), PY_INCLUDE_LIST (array), PY_LIBDIR, PY_LIB (libpython's -l
# name), EXT_SUFFIX and PY_TAG (cpXY) for $VENV's Python, else python3 on PATH.
python_build_info() {
  VENV=${VENV:-$ROOT/.venv}
  if [ -x "$VENV/bin/python" ]; then
    PY=$VENV/bin/python
  else
    PY=$(command -v python3) || die "no Python: no $VENV/bin/python and no python3 on PATH"
  fi
  local info include_dirs shared
  info=$("$PY" - <<'EOF'
import sys
import sysconfig as s
inc = {s.get_paths()["include"], s.get_paths()["platinclude"]}
print(":".join(sorted(inc)))
print(s.get_config_var("LIBDIR") or "")
print("python" + (s.get_config_var("LDVERSION") or s.get_python_version()))
print(s.get_config_var("EXT_SUFFIX") or ".so")
print(s.get_config_var("Py_ENABLE_SHARED") or 0)
print("cp%d%d" % sys.version_info[:2])
EOF
  ) || die "cannot query $PY's sysconfig"
  { read -r include_dirs; read -r PY_LIBDIR; read -r PY_LIB; read -r EXT_SUFFIX; read -r shared; read -r PY_TAG; } <<<"$info"
  IFS=: read -r -a PY_INCLUDE_LIST <<<"$include_dirs"
  [ "$shared" = 1 ] && [ -e "$PY_LIBDIR/lib$PY_LIB.so" ] ||
    die "$PY has no shared lib$PY_LIB.so in '$PY_LIBDIR': needed to link with --no-undefined"
}

# True (0) when the libraries in DIR were built with _GLIBCXX_USE_CXX11_ABI=1: functions
# returning std::string then carry the [abi:cxx11] tag (mangled "B5cxx11").
# (grep -c, not grep -q: an early exit would SIGPIPE nm and fail the pipeline.)
cxx11_abi_of() {  # cxx11_abi_of LIBC10_SO -> prints 1 or 0
  local tagged
  tagged=$(nm -D --defined-only "$1" | grep -c 'B5cxx11' || true)
  if [ "${tagged:-0}" -gt 0 ]; then echo 1; else echo 0; fi
}

# ---- Wheels ------------------------------------------------------------------------------
# find_or_download_wheel DIR GLOB WHAT PIP_DOWNLOAD_ARGS...: sets WHEEL to the first DIR/GLOB,
# after `pip download PIP_DOWNLOAD_ARGS... -d DIR` when there is none; returns 1 if pip fails.
find_or_download_wheel() {
  local dir=$1 glob=$2 what=$3
  shift 3
  mkdir -p "$dir"
  # shellcheck disable=SC2086  # $glob is a pattern
  WHEEL=$(ls -1 "$dir"/$glob 2>/dev/null | head -n 1 || true)
  [ -n "$WHEEL" ] && return 0
  log "downloading $what into $dir"
  "$PY" -m pip download --isolated --no-deps --quiet "$@" -d "$dir" || return 1
  # shellcheck disable=SC2086
  WHEEL=$(ls -1 "$dir"/$glob 2>/dev/null | head -n 1 || true)
  [ -n "$WHEEL" ] || die "pip download left no $glob in $dir"
}

# unpack_wheel WHEEL CACHE MEMBER_PATTERN...: sets UNPACKED to CACHE/<wheel>-<size>, into
# which those members of WHEEL are unpacked once (an interrupted unpack is redone).
unpack_wheel() {
  local wheel=$1 cache=$2
  shift 2
  UNPACKED=$cache/$(basename "$wheel" .whl)-$(stat -c %s "$wheel")
  [ -e "$UNPACKED/.complete" ] && return 0
  log "unpacking $* of $(basename "$wheel")"
  rm -rf "$UNPACKED" "$UNPACKED.tmp"
  unzip -q -o "$wheel" "$@" -d "$UNPACKED.tmp" || die "cannot unpack $wheel"
  mv "$UNPACKED.tmp" "$UNPACKED"
  touch "$UNPACKED/.complete"
}

# ---- Bounded parallel compile ---------------------------------------------------------
# compile_job SRC COMPILER FLAGS...: runs `COMPILER FLAGS... -c SRC -o $BUILD/<src>.o` in the
# background, at most $JOBS at once, its output in $BUILD/<src>.log; OBJECTS collects the
# objects in order.
# compile_wait: waits for all, prints every warning, dies naming the sources that failed.
OBJECTS=()
_RUNNING=()
_FAILED=()
declare -A _LOG_OF=() _SRC_OF=()
_reap_oldest() {
  local pid=${_RUNNING[0]}
  _RUNNING=("${_RUNNING[@]:1}")
  if ! wait "$pid"; then _FAILED+=("$pid"); fi
}
compile_job() {
  local src=$1
  shift
  while [ "${#_RUNNING[@]}" -ge "$JOBS" ]; do _reap_oldest; done
  local base
  base=$BUILD/$(echo "$src" | tr '/' '_')
  OBJECTS+=("$base.o")
  "$@" -c "$src" -o "$base.o" >"$base.log" 2>&1 &
  _RUNNING+=("$!")
  _LOG_OF[$!]=$base.log
  _SRC_OF[$!]=$src
}
compile_wait() {
  while [ "${#_RUNNING[@]}" -gt 0 ]; do _reap_oldest; done
  WARNINGS=0
  local logf pid failed=()
  for logf in "$BUILD"/*.log; do
    if grep -q 'warning' "$logf"; then
      WARNINGS=$((WARNINGS + $(grep -c 'warning' "$logf")))
      echo "---- warnings in $(basename "$logf" .log):" >&2
      grep -B2 -A4 'warning' "$logf" >&2 || true
    fi
  done
  for pid in "${_FAILED[@]}"; do
    echo "---- ${_SRC_OF[$pid]} failed to compile:" >&2
    cat "${_LOG_OF[$pid]}" >&2
    failed+=("${_SRC_OF[$pid]}")
  done
  [ "${#failed[@]}" -eq 0 ] || die "compilation failed: ${failed[*]}"
}

# link_so SO LINK_COMMAND...: runs the link, its messages in $BUILD/link.log; dies on
# failure. "needed by X, not found" lines are dropped: they name the dependencies of the
# libraries we link against (not installed here), which are not ours to check.
link_so() {
  local so=$1
  shift
  local link_log=$BUILD/link.log
  if ! "$@" >"$link_log" 2>&1; then
    grep -v 'needed by .*, not found (try using -rpath or -rpath-link)' "$link_log" >&2 || true
    die "linking $so failed (undefined symbols above)"
  fi
  if grep -v 'needed by .*, not found (try using -rpath or -rpath-link)' "$link_log" | grep -q .; then
    echo "---- linker messages:" >&2
    grep -v 'needed by .*, not found (try using -rpath or -rpath-link)' "$link_log" >&2
  fi
}

# Dynamic symbols of a shared object, versions stripped, one a line.
undefined_symbols() { nm -D --undefined-only "$1" | awk '{print $NF}' | sed 's/@.*//'; }
defined_symbols() { nm -D --defined-only "$1" | awk '{print $NF}' | sed 's/@.*//'; }
needed_libs() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
