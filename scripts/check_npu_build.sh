#!/usr/bin/env bash
# Compiles AND links the whole torch_kvops extension with its Ascend NPU backend against
# the real torch_npu, on a machine without CANN or an NPU (CI). Nothing is loaded or run.
#
# What it proves:
#   * every source the NPU build compiles (torch_bindings.cpp, csrc/core/*.cpp,
#     csrc/cpu/*.cpp, csrc/npu/*.cpp, with KVOPS_WITH_NPU=1 as setup.py defines it)
#     compiles against torch_npu's own C++ headers and the ACL headers bundled with it
#     (the headers setup.py builds against), with -Wall -Wextra -Werror on our files
#     (torch, torch_npu, ACL and Python headers are -isystem: their warnings are not ours);
#   * the result links with -Wl,--no-undefined against the real libtorch_npu.so, torch's
#     libraries, libpython and a link-time stand-in for libascendcl.so that defines every
#     function declared by the wheel's <acl/acl.h> (ACL 1.17 for torch_npu 2.13): each
#     symbol we use exists, with the C++ ABI of the wheel;
#   * every ACL symbol the extension imports directly is one that libtorch_npu.so itself
#     imports directly (so any CANN that torch_npu loads on has it); all other ACL entry
#     points must be resolved at run time (csrc/npu/kvops_npu.cpp), and the names of those
#     are listed.
#
# What it cannot prove:
#   * run-time behaviour: nothing here executes ACL or torch_npu code (`import torch_npu`
#     needs CANN's libhccl.so and friends); the stand-in's functions are empty;
#   * that a given CANN release exports the symbols: the stand-in follows the wheel's
#     headers, not an installed libascendcl.so (the direct-import rule above is the guard);
#   * code generated with -O3 (setup.py's level): -O0 here, which is ~2x faster to compile
#     and reports the same diagnostics for our sources except optimizer-driven ones.
#
# Inputs are cached under .npu-check/ (gitignored): the torch_npu wheel in
# .npu-check/wheels/ (`pip download --no-deps --only-binary=:all: --platform
# manylinux_2_28_x86_64 torch-npu==$KVOPS_TORCH_NPU_VERSION`, ~44 MB, once), its headers
# and libtorch_npu.so unpacked next to it, and the build in .npu-check/build/, which is
# reused while the sources, this script, the wheel, torch and the compiler are unchanged.
# tests/test_npu_build.py reads the build (_C*.so, acl-stub/libascendcl.so,
# libtorch_npu.so -> the unpacked one).
#
# torch headers and libraries come from $VENV's torch (the CPU build of the same release:
# torch_npu's x86_64 wheel is built against it). Python: $VENV's.
#
# Environment: VENV (default .venv), KVOPS_TORCH_NPU_WHEEL (a local torch_npu wheel),
# KVOPS_TORCH_NPU_VERSION (default 2.13.0), KVOPS_CHECK_JOBS (default 2),
# KVOPS_CXX_STD (default c++20, what torch 2.13's cpp_extension uses),
# KVOPS_NPU_CHECK_REBUILD=1 (ignore the cached build).
set -euo pipefail
export LC_ALL=C  # sort and comm must agree on the order

START=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CHECK_NAME=check_npu_build
# shellcheck source=build_check_lib.sh
source "$ROOT/scripts/build_check_lib.sh"

require_tools g++ gcc unzip nm readelf strings sha256sum
python_build_info

# ---- torch (from the venv) --------------------------------------------------------------
# Located, not imported: importing torch costs seconds, and a cached check takes ~2 s.
TORCH_ROOT=$("$PY" -c 'import importlib.util as u; print(u.find_spec("torch").submodule_search_locations[0])') ||
  die "no torch in $PY's environment"
TORCH_FULL=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$TORCH_ROOT/version.py")
[ -n "$TORCH_FULL" ] || die "cannot read torch's version from $TORCH_ROOT/version.py"
TI=$TORCH_ROOT/include
TL=$TORCH_ROOT/lib

# ---- torch_npu wheel ------------------------------------------------------------------
CACHE=$ROOT/.npu-check
NPU_VERSION=${KVOPS_TORCH_NPU_VERSION:-2.13.0}
# torch_npu X.Y.Z requires torch==X.Y.Z.*: its headers and libtorch_npu.so match that torch.
[ "${TORCH_FULL%%+*}" = "$NPU_VERSION" ] ||
  die "the venv has torch $TORCH_FULL but torch_npu $NPU_VERSION is built against torch $NPU_VERSION;" \
      "set KVOPS_TORCH_NPU_VERSION or use a matching venv"
if [ -n "${KVOPS_TORCH_NPU_WHEEL:-}" ]; then
  WHEEL=$KVOPS_TORCH_NPU_WHEEL
  [ -f "$WHEEL" ] || die "KVOPS_TORCH_NPU_WHEEL=$WHEEL is not a file"
else
  # Only a wheel for this Python (the wheels differ by the tag only, but pip picks by it).
  find_or_download_wheel "$CACHE/wheels" "torch_npu-$NPU_VERSION-$PY_TAG-$PY_TAG-manylinux_2_28_x86_64.whl" \
      "torch-npu==$NPU_VERSION (manylinux_2_28_x86_64 wheel, ~44 MB)" \
      --only-binary=:all: --platform manylinux_2_28_x86_64 "torch-npu==$NPU_VERSION" ||
    die "pip download torch-npu==$NPU_VERSION failed; set KVOPS_TORCH_NPU_WHEEL to a local torch_npu wheel"
fi
unpack_wheel "$WHEEL" "$CACHE" 'torch_npu/include/*' 'torch_npu/lib/libtorch_npu.so'
NI=$UNPACKED/torch_npu/include
NL=$UNPACKED/torch_npu/lib
[ -e "$NL/libtorch_npu.so" ] || die "libtorch_npu.so is missing from $WHEEL"
for header in torch_npu/csrc/core/npu/NPUStream.h torch_npu/csrc/core/npu/NPUGuard.h acl/acl.h; do
  [ -e "$NI/$header" ] || die "$header is missing from $WHEEL"
done

CXX11_ABI=$(cxx11_abi_of "$TL/libc10.so")
[ "$(cxx11_abi_of "$NL/libtorch_npu.so")" = "$CXX11_ABI" ] ||
  die "libtorch_npu.so and torch's libc10.so disagree on _GLIBCXX_USE_CXX11_ABI"

# ---- Flags (as setup.py's NPU build, at -O0) ----------------------------------------------
CXX_STD=${KVOPS_CXX_STD:-c++20}
JOBS=${KVOPS_CHECK_JOBS:-2}
BUILD=$CACHE/build
SO=$BUILD/_C$EXT_SUFFIX
STUB_DIR=$BUILD/acl-stub

DEFS=(-DKVOPS_WITH_CUDA=0 -DKVOPS_WITH_NPU=1 -DTORCH_EXTENSION_NAME=_C
      -DTORCH_API_INCLUDE_EXTENSION_H "-D_GLIBCXX_USE_CXX11_ABI=$CXX11_ABI")
# torch_npu's include first, as in setup.py and torch_npu.utils.cpp_extension.NpuExtension:
# its ACL headers are the ones torch_npu was built with.
INCS=(-isystem "$NI" -isystem "$NI/third_party/hccl/inc"
      -isystem "$TI" -isystem "$TI/torch/csrc/api/include")
for dir in "${PY_INCLUDE_LIST[@]}"; do INCS+=(-isystem "$dir"); done
CXXFLAGS=(-std="$CXX_STD" -fPIC -O0 -fopenmp -Wall -Wextra -Wno-unused-parameter -Werror
          "${DEFS[@]}" "${INCS[@]}")
# The largest translation units first: two jobs then finish closer together.
mapfile -t SOURCES < <(ls -1 csrc/torch_bindings.cpp csrc/npu/*.cpp csrc/cpu/*.cpp csrc/core/*.cpp)
[ -n "$(ls -1 csrc/npu/*.cpp 2>/dev/null)" ] || die "no csrc/npu/*.cpp to check"

# The cached build is reused only for the same sources (every file they can include),
# check scripts, wheel, torch, compiler and flags.
KEY=$( {
  for f in $(ls -1 csrc/torch_bindings.cpp csrc/core/* csrc/cpu/* csrc/npu/* \
               scripts/check_npu_build.sh scripts/build_check_lib.sh | sort); do
    echo "$f"; cat "$f"
  done
  basename "$WHEEL"; stat -c %s "$WHEEL"; echo "$TORCH_FULL $TORCH_ROOT"; g++ --version | head -n 1
  echo "${CXXFLAGS[*]}"
} | sha256sum | cut -c1-16)

if [ "${KVOPS_NPU_CHECK_REBUILD:-0}" != 1 ] && [ -e "$SO" ] && [ "$(cat "$BUILD/.key" 2>/dev/null)" = "$KEY" ]; then
  log "sources unchanged since the last build ($KEY): inspecting $(basename "$SO")"
else
  rm -rf "$BUILD"
  mkdir -p "$STUB_DIR"

  # ---- Link-time stand-in for libascendcl.so --------------------------------------------
  # One empty function per function declared in the headers <acl/acl.h> pulls in (the
  # AscendCL API that libascendcl.so exports), with libascendcl.so's soname.
  mapfile -t ACL_HEADERS < <(echo '#include <acl/acl.h>' | g++ -x c++ -M -I"$NI" - |
                               tr ' \\' '\n\n' | grep '/acl/.*\.h$' | sort -u)
  [ "${#ACL_HEADERS[@]}" -gt 0 ] || die "cannot list the headers of $NI/acl/acl.h"
  sed -nE 's/.*ACL_FUNC_VISIBILITY[^(]*[^A-Za-z0-9_](acl[A-Za-z0-9_]+)[[:space:]]*\(.*/\1/p' \
      "${ACL_HEADERS[@]}" | sort -u >"$STUB_DIR/functions.txt"
  grep -qx aclrtMemcpyAsync "$STUB_DIR/functions.txt" ||
    die "no aclrtMemcpyAsync among the functions declared by $NI/acl/acl.h: stub generation broken"
  sed 's/.*/void &(void) {}/' "$STUB_DIR/functions.txt" >"$STUB_DIR/libascendcl_stub.c"
  gcc -shared -fPIC -Wl,-soname,libascendcl.so -o "$STUB_DIR/libascendcl.so" \
      "$STUB_DIR/libascendcl_stub.c" || die "cannot build the libascendcl.so stand-in"

  # ---- Compile ---------------------------------------------------------------------------
  log "torch $TORCH_FULL, torch_npu $NPU_VERSION ($(basename "$WHEEL")), -std=$CXX_STD, _GLIBCXX_USE_CXX11_ABI=$CXX11_ABI, $JOBS jobs, -Werror"
  for src in "${SOURCES[@]}"; do compile_job "$src" g++ "${CXXFLAGS[@]}"; done
  compile_wait

  # ---- Link ------------------------------------------------------------------------------
  # --no-undefined: every symbol our objects use must come from the listed libraries.
  # --allow-shlib-undefined: libtorch_npu.so's own CANN dependencies (libhccl, libge_runner,
  # ...) are not here; their symbols are not ours to check.
  link_so "$SO" g++ -shared -fopenmp -o "$SO" "${OBJECTS[@]}" \
      -L"$STUB_DIR" -L"$NL" -L"$TL" -L"$PY_LIBDIR" \
      -Wl,--no-undefined -Wl,--allow-shlib-undefined \
      -Wl,-rpath-link,"$TL" -Wl,-rpath-link,"$STUB_DIR" \
      -lascendcl -ltorch_npu -ltorch_cpu -ltorch -lc10 -ltorch_python -ldl -l"$PY_LIB"
  ln -sfn "$NL/libtorch_npu.so" "$BUILD/libtorch_npu.so"
  echo "$KEY" >"$BUILD/.key"
fi

# ---- Inspect the shared object -----------------------------------------------------------
UNDEFINED=$(undefined_symbols "$SO")
NEEDED=$(needed_libs "$SO")
grep -qx "PyInit__C" <<<"$(defined_symbols "$SO")" || die "$SO does not define PyInit__C"
grep -q '^_ZN7c10_npu' <<<"$UNDEFINED" ||
  die "$SO references no c10_npu symbol: the NPU backend was not compiled in"
for lib in libascendcl.so libtorch_npu.so; do
  grep -qx "$lib" <<<"$NEEDED" || die "$SO does not link $lib"
done

# ACL entry points linked directly must be ones libtorch_npu.so imports directly itself.
OURS_DIRECT=$(grep -E '^acl[A-Za-z0-9_]+$' <<<"$UNDEFINED" | sort -u || true)
NPU_DIRECT=$(undefined_symbols "$NL/libtorch_npu.so" | grep -E '^acl[A-Za-z0-9_]+$' | sort -u)
NOT_IN_NPU=$(comm -23 <(echo "$OURS_DIRECT") <(echo "$NPU_DIRECT") | grep . || true)
[ -z "$NOT_IN_NPU" ] ||
  die "$SO links ACL entry points that libtorch_npu.so does not import directly: $(echo $NOT_IN_NPU)." \
      "A CANN without them could not load torch_kvops: resolve them at run time (csrc/npu/acl_binding.h)"
# Names of ACL functions that appear in the .so only as strings: the run-time lookups.
RUNTIME=$(strings -a "$SO" | grep -xE 'acl[A-Za-z0-9_]+' | sort -u |
          comm -12 - "$STUB_DIR/functions.txt" | comm -23 - <(echo "$OURS_DIRECT") || true)

log "ACL linked directly: $(echo $OURS_DIRECT)"
log "ACL resolved at run time: $(echo $RUNTIME)"
log "OK: compiled ${#SOURCES[@]} sources (-Werror) and linked $(basename "$SO") (--no-undefined) against torch $TORCH_FULL + torch_npu $NPU_VERSION + a libascendcl.so stand-in ($(wc -l <"$STUB_DIR/functions.txt") functions); $((SECONDS - START))s"
