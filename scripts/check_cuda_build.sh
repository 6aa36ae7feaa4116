#!/usr/bin/env bash
# Compiles AND links the whole torch_kvops extension with its CUDA backend against the
# CUDA build of torch, on a machine without a GPU (CI). Nothing is loaded or run: this
# catches compile errors, missing symbols and wrong linkage of csrc/cuda/*.cu.
#
#   * torch_bindings.cpp, csrc/core/*.cpp, csrc/cpu/*.cpp: g++ (as setup.py would, with
#     KVOPS_WITH_CUDA=1); csrc/cuda/*.cu: the toolkit's nvcc.
#   * Headers and libraries come from the CUDA torch wheel: $KVOPS_TORCH_CUDA_WHEEL if
#     set, else a wheel already in .cuda-check/wheels/, else
#     `pip download --isolated --no-deps torch==$KVOPS_TORCH_VERSION` (default 2.13.0,
#     the cu130 wheel on PyPI, ~530 MB). Only torch/include and torch/lib are unpacked.
#   * Linked with g++ -shared -Wl,--no-undefined against torch, c10, torch_python,
#     cudart and libpython, so every undefined symbol of our own objects must resolve.
#   * The .so must reference the runtime entry points the CUDA backend depends on and
#     must not link libcuda (the batch memcpy is resolved at run time).
#
# Environment: VENV (default .venv), KVOPS_TORCH_CUDA_WHEEL, KVOPS_TORCH_VERSION,
# CUDA_HOME (default: from nvcc on PATH), KVOPS_CHECK_JOBS (default 2),
# KVOPS_CXX_STD (default c++20, what torch 2.13's cpp_extension uses),
# KVOPS_CHECK_WERROR=1 (warnings in csrc/ fail the check).
set -euo pipefail

START=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CHECK_NAME=check_cuda_build
# shellcheck source=build_check_lib.sh
source "$ROOT/scripts/build_check_lib.sh"

require_tools g++ unzip nm readelf
python_build_info

# ---- CUDA toolkit -------------------------------------------------------------------
# The first of $CUDA_HOME, $CUDA_PATH, nvcc's prefix on PATH, /usr/local/cuda that holds
# a toolkit (nvcc on PATH may be a wrapper script, so its prefix is only a guess).
CANDIDATES=("${CUDA_HOME:-}" "${CUDA_PATH:-}")
if command -v nvcc >/dev/null; then
  CANDIDATES+=("$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
fi
CANDIDATES+=(/usr/local/cuda)
CUDA_HOME=
for dir in "${CANDIDATES[@]}"; do
  if [ -n "$dir" ] && [ -x "$dir/bin/nvcc" ] && [ -e "$dir/include/cuda.h" ]; then
    CUDA_HOME=$dir
    break
  fi
done
[ -n "$CUDA_HOME" ] || die "no CUDA toolkit found (tried: ${CANDIDATES[*]}); set CUDA_HOME"
NVCC=$CUDA_HOME/bin/nvcc
CUDA_LIBDIR=$CUDA_HOME/lib64
[ -e "$CUDA_LIBDIR/libcudart.so" ] || CUDA_LIBDIR=$CUDA_HOME/targets/x86_64-linux/lib
[ -e "$CUDA_LIBDIR/libcudart.so" ] || die "libcudart.so not found under $CUDA_HOME"
NVCC_VERSION=$("$NVCC" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
[ -n "$NVCC_VERSION" ] || die "cannot read the version of $NVCC"

# ---- CUDA torch wheel -----------------------------------------------------------------
CACHE=$ROOT/.cuda-check
TORCH_VERSION=${KVOPS_TORCH_VERSION:-2.13.0}
if [ -n "${KVOPS_TORCH_CUDA_WHEEL:-}" ]; then
  WHEEL=$KVOPS_TORCH_CUDA_WHEEL
  [ -f "$WHEEL" ] || die "KVOPS_TORCH_CUDA_WHEEL=$WHEEL is not a file"
else
  # Only a wheel for this Python: libtorch_python must match the libpython we link.
  find_or_download_wheel "$CACHE/wheels" "torch-$TORCH_VERSION-$PY_TAG-*.whl" \
      "torch==$TORCH_VERSION (CUDA wheel, ~530 MB)" "torch==$TORCH_VERSION" ||
    die "pip download torch==$TORCH_VERSION failed; set KVOPS_TORCH_CUDA_WHEEL to a local CUDA torch wheel"
fi
WHEEL_VERSION_PY=$(unzip -p "$WHEEL" torch/version.py) || die "$WHEEL is not a torch wheel"
TORCH_FULL=$(sed -n "s/^__version__ = '\(.*\)'/\1/p" <<<"$WHEEL_VERSION_PY")
TORCH_CUDA=$(sed -n "s/^cuda: Optional\[str\] = '\(.*\)'/\1/p" <<<"$WHEEL_VERSION_PY")
[ -n "$TORCH_CUDA" ] ||
  die "$WHEEL ($TORCH_FULL) is not a CUDA build of torch; point KVOPS_TORCH_CUDA_WHEEL at one"
[ "${TORCH_CUDA%%.*}" = "${NVCC_VERSION%%.*}" ] ||
  die "torch $TORCH_FULL was built with CUDA $TORCH_CUDA but nvcc is CUDA $NVCC_VERSION (major versions must match)"

unpack_wheel "$WHEEL" "$CACHE" 'torch/include/*' 'torch/lib/*'
TORCH_DIR=$UNPACKED
TI=$TORCH_DIR/torch/include
TL=$TORCH_DIR/torch/lib
for lib in libc10.so libc10_cuda.so libtorch.so libtorch_cpu.so libtorch_cuda.so libtorch_python.so; do
  [ -e "$TL/$lib" ] || die "$lib is missing from $WHEEL"
done

CXX11_ABI=$(cxx11_abi_of "$TL/libc10.so")  # the wheel's libstdc++ ABI

# ---- Compile ----------------------------------------------------------------------------
CXX_STD=${KVOPS_CXX_STD:-c++20}
JOBS=${KVOPS_CHECK_JOBS:-2}
BUILD=$CACHE/build
rm -rf "$BUILD"
mkdir -p "$BUILD"

DEFS=(-DKVOPS_WITH_CUDA=1 -DKVOPS_WITH_NPU=0 -DTORCH_EXTENSION_NAME=_C
      -DTORCH_API_INCLUDE_EXTENSION_H "-D_GLIBCXX_USE_CXX11_ABI=$CXX11_ABI")
# -isystem: warnings are reported for csrc/ only, not for torch's headers.
INCS=(-isystem "$TI" -isystem "$TI/torch/csrc/api/include" -isystem "$CUDA_HOME/include")
for dir in "${PY_INCLUDE_LIST[@]}"; do INCS+=(-isystem "$dir"); done
WARN=(-Wall -Wextra -Wno-unused-parameter)
[ "${KVOPS_CHECK_WERROR:-0}" = 1 ] && WARN+=(-Werror)
# -O0: this checks compilation and linkage, not generated code, and is ~2x faster.
# -fopenmp as setup.py: at::parallel_for's pragma is compiled into our objects.
CXXFLAGS=(-std="$CXX_STD" -fPIC -O0 -fopenmp "${WARN[@]}" "${DEFS[@]}" "${INCS[@]}")
WARN_CSV=$(IFS=,; echo "${WARN[*]}")
# Same preprocessor setup as torch.utils.cpp_extension's COMMON_NVCC_FLAGS.
NVCCFLAGS=(-std="$CXX_STD" -O0 -Xcompiler "-fPIC,$WARN_CSV" --expt-relaxed-constexpr
           -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
           -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
           "${DEFS[@]}" "${INCS[@]}")

mapfile -t CU_SOURCES < <(ls -1 csrc/cuda/*.cu 2>/dev/null || true)
mapfile -t CXX_SOURCES < <(ls -1 csrc/torch_bindings.cpp csrc/core/*.cpp csrc/cpu/*.cpp)
[ "${#CU_SOURCES[@]}" -gt 0 ] || die "no csrc/cuda/*.cu to check"

log "torch $TORCH_FULL (CUDA $TORCH_CUDA), nvcc $NVCC_VERSION, -std=$CXX_STD, _GLIBCXX_USE_CXX11_ABI=$CXX11_ABI, $JOBS jobs"
# The .cu files first: they take longest.
for src in "${CU_SOURCES[@]}"; do
  compile_job "$src" "$NVCC" "${NVCCFLAGS[@]}"
done
for src in "${CXX_SOURCES[@]}"; do
  compile_job "$src" g++ "${CXXFLAGS[@]}"
done
compile_wait

# ---- Link --------------------------------------------------------------------------
SO=$BUILD/_C$EXT_SUFFIX
# --no-undefined: every symbol our objects use must come from the listed libraries.
# --allow-shlib-undefined: the wheel's own dependencies (cuBLAS, cuDNN, NCCL, ... from
# nvidia-* wheels) are not installed here; their symbols are not ours to check.
link_so "$SO" g++ -shared -fopenmp -o "$SO" "${OBJECTS[@]}" \
    -L"$TL" -L"$CUDA_LIBDIR" -L"$PY_LIBDIR" \
    -Wl,--no-undefined -Wl,--allow-shlib-undefined \
    -Wl,-rpath-link,"$TL" -Wl,-rpath-link,"$CUDA_LIBDIR" \
    -ltorch_cuda -lc10_cuda -ltorch_cpu -ltorch -lc10 -ltorch_python -lcudart -l"$PY_LIB"

# ---- Inspect the shared object -----------------------------------------------------------
UNDEFINED=$(undefined_symbols "$SO")
DEFINED=$(defined_symbols "$SO")
NEEDED=$(needed_libs "$SO")
REQUIRED_SYMBOLS=(cudaGetDriverEntryPointByVersion cudaLaunchHostFunc cudaEventRecordWithFlags
                  cudaMemcpyAsync cudaStreamIsCapturing cudaThreadExchangeStreamCaptureMode
                  cudaEventQuery cudaPointerGetAttributes cudaHostAlloc cudaEventSynchronize
                  __cudaRegisterFunction)  # the last: a kernel of copy_kernel.cu is registered
for sym in "${REQUIRED_SYMBOLS[@]}"; do
  grep -qx "$sym" <<<"$UNDEFINED" || die "$SO does not reference $sym (CUDA backend incomplete?)"
done
grep -qx "PyInit__C" <<<"$DEFINED" || die "$SO does not define PyInit__C"
if grep -q '^cuMemcpyBatchAsync\|^cu[A-Z]' <<<"$UNDEFINED"; then
  die "$SO references driver symbols directly ($(grep '^cu[A-Z]' <<<"$UNDEFINED" | tr '\n' ' ')): resolve them at run time instead"
fi
# (libtorch_cuda.so itself may be dropped by a default --as-needed: nothing of ours
# calls into it directly, and libtorch.so loads it.)
grep -qx "libc10_cuda.so" <<<"$NEEDED" || die "$SO does not link libc10_cuda.so"
grep -q '^libcudart\.so' <<<"$NEEDED" || die "$SO does not link libcudart"
if grep -q '^libcuda\.so\|^libcublas\|^libcusparse' <<<"$NEEDED"; then
  die "$SO links $(grep '^libcuda\.so\|^libcublas\|^libcusparse' <<<"$NEEDED" | tr '\n' ' '): it must not"
fi

log "OK: compiled ${#CXX_SOURCES[@]} C++ + ${#CU_SOURCES[@]} CUDA sources and linked $(basename "$SO") (--no-undefined) against torch $TORCH_FULL/CUDA $TORCH_CUDA; ${#REQUIRED_SYMBOLS[@]} CUDA runtime symbols referenced, no libcuda; $WARNINGS warning(s); $((SECONDS - START))s"
