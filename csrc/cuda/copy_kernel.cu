// The block-copy kernel: one warp per work item (a descriptor, or a <= 16 KiB piece of
// one), items strided over a bounded grid. Why warps and not one block per item: a
// 2 KiB block is 128 16-byte vectors, so a 256-thread block would leave half its
// threads idle and keep only 2 KiB in flight; eight warps keep eight items in flight.
// Over PCIe each read is a ~1-2 us round trip, so bytes in flight set the bandwidth.
//
// Vector width per item: the widest of 16/8/4/2/1 bytes at which source and
// destination are equally misaligned; a byte-wise head brings both to that alignment
// and a byte-wise tail finishes, so any address and any size is copied exactly.
// Four vectors per thread are loaded before any is stored (memory-level parallelism).
#include "copy_kernel.h"

#include "../core/copy_constants.h"

namespace kvops {
namespace cuda_copy {
namespace {

constexpr int kThreads = kKernelThreads;
constexpr int kWarps = kKernelWarpsPerCta;
constexpr int kUnroll = 4;

template <size_t N>
struct ItemsParam {
  uint64_t count;
  Item items[N];
};

template <typename V>
__device__ __forceinline__ void copy_vectors(const char* src, char* dst, size_t n, int lane) {
  // Head: bytes until src (hence dst) is V-aligned.
  size_t head = (sizeof(V) - reinterpret_cast<uintptr_t>(src) % sizeof(V)) % sizeof(V);
  if (head > n) head = n;
  if (static_cast<size_t>(lane) < head) dst[lane] = src[lane];
  src += head;
  dst += head;
  n -= head;
  const size_t vecs = n / sizeof(V);
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  size_t i = lane;
  for (; i + (kUnroll - 1) * 32 < vecs; i += kUnroll * 32) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = s[i + u * 32];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * 32] = r[u];
  }
  for (; i < vecs; i += 32) d[i] = s[i];
  // Tail: fewer than sizeof(V) bytes.
  const size_t done = vecs * sizeof(V);
  const size_t tail = n - done;
  if (static_cast<size_t>(lane) < tail) dst[done + lane] = src[done + lane];
}

__device__ __forceinline__ void copy_item(const Item& item, int lane) {
  const char* src = reinterpret_cast<const char*>(item.src);
  char* dst = reinterpret_cast<char*>(item.dst);
  const size_t n = item.bytes;
  const uintptr_t skew = (item.src ^ item.dst);
  if ((skew & 15) == 0) {
    copy_vectors<uint4>(src, dst, n, lane);
  } else if ((skew & 7) == 0) {
    copy_vectors<uint2>(src, dst, n, lane);
  } else if ((skew & 3) == 0) {
    copy_vectors<uint32_t>(src, dst, n, lane);
  } else if ((skew & 1) == 0) {
    copy_vectors<uint16_t>(src, dst, n, lane);
  } else {
    copy_vectors<uint8_t>(src, dst, n, lane);
  }
}

__device__ __forceinline__ void copy_items(const Item* items, size_t count) {
  const int lane = threadIdx.x % 32;
  const size_t warp = static_cast<size_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const size_t stride = static_cast<size_t>(gridDim.x) * kWarps;
  for (size_t k = warp; k < count; k += stride) copy_item(items[k], lane);
}

// __grid_constant__: the items are read from the parameter space in place; without it
// a dynamically indexed parameter array is copied to every thread's local memory.
template <size_t N>
__global__ void __launch_bounds__(kThreads) copy_by_value(const __grid_constant__ ItemsParam<N> p) {
  copy_items(p.items, p.count);
}

__global__ void __launch_bounds__(kThreads) copy_from_table(const Item* items, size_t count) {
  copy_items(items, count);
}

template <size_t N>
cudaError_t launch(const Item* items, size_t count, int grid, cudaStream_t stream) {
  if (count > N) return cudaErrorInvalidValue;
  ItemsParam<N> p;
  p.count = count;
  for (size_t k = 0; k < count; ++k) p.items[k] = items[k];
  copy_by_value<N><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

static_assert(sizeof(ItemsParam<kItemsByValueSmall>) <= 4096, "kernel parameters above 4 KiB");
static_assert(sizeof(ItemsParam<kItemsByValueLarge>) <= 32764, "kernel parameters above 32764 bytes");

}  // namespace

cudaError_t launch_by_value(const Item* items, size_t count, int grid, bool large_params,
                            cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (grid < 1) return cudaErrorInvalidValue;
  // A small batch does not pay for (or, captured, store) 32 KiB of parameters.
  if (count <= kItemsByValueSmall) return launch<kItemsByValueSmall>(items, count, grid, stream);
#if CUDART_VERSION >= 12010
  if (large_params) return launch<kItemsByValueLarge>(items, count, grid, stream);
#endif
  return launch<kItemsByValueSmall>(items, count, grid, stream);
}

cudaError_t launch_from_table(const Item* device_items, size_t count, int grid,
                              cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (grid < 1) return cudaErrorInvalidValue;
  copy_from_table<<<grid, kThreads, 0, stream>>>(device_items, count);
  return cudaGetLastError();
}

}  // namespace cuda_copy
}  // namespace kvops
