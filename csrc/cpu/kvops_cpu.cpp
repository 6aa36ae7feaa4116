// CPU backend: block copies split over torch's intra-op thread pool, and trivially complete
// events.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "../core/block_plan.h"
#include "../core/layer_events.h"

namespace kvops {
namespace {

// Below this a single thread wins: thread wake-up costs more than the copy.
constexpr size_t kParallelThresholdBytes = size_t{1} << 20;
constexpr size_t kChunkBytes = size_t{256} << 10;

// Copies larger than the last-level cache gain from streaming (non-temporal) stores:
// the destination is not read into the cache first, which is what a plain memcpy of
// a small block does. glibc only streams for single very large copies, so a batch of
// 16 KiB blocks would otherwise move ~1.5x the bytes.
constexpr size_t kStreamingThresholdBytes = size_t{8} << 20;

void stream_copy(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  size_t head = (16 - reinterpret_cast<uintptr_t>(dst) % 16) % 16;
  head = std::min(head, n);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const size_t body = n / 64 * 64;
  for (size_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + body, src + body, n - body);
#else
  std::memcpy(dst, src, n);
#endif
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();  // streaming stores are weakly ordered: publish before returning
#endif
}

// Copies the byte range [begin, end) of the concatenation of all descriptors, so a
// few huge blocks and many tiny ones split across threads equally well.
void copy_byte_range(const std::vector<CopyDesc>& descs, const std::vector<size_t>& offsets,
                     size_t begin, size_t end, bool streaming) {
  size_t k = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
  while (begin < end && k < descs.size()) {
    const size_t within = begin - offsets[k];
    const size_t n = std::min(descs[k].bytes - within, end - begin);
    auto* dst = reinterpret_cast<char*>(descs[k].dst + within);
    const auto* src = reinterpret_cast<const char*>(descs[k].src + within);
    if (streaming) {
      stream_copy(dst, src, n);
    } else {
      std::memcpy(dst, src, n);
    }
    begin += n;
    ++k;
  }
}

bool streaming_allowed() {
  static const bool allow = [] {
    const char* env = std::getenv("KVOPS_CPU_STREAMING");
    return env == nullptr || std::string(env) != "0";
  }();
  return allow;
}

void parallel_memcpy(const std::vector<CopyDesc>& descs) {
  std::vector<size_t> offsets(descs.size() + 1, 0);
  for (size_t k = 0; k < descs.size(); ++k) offsets[k + 1] = offsets[k] + descs[k].bytes;
  const size_t total = offsets.back();
  const bool streaming = streaming_allowed() && total >= kStreamingThresholdBytes;
  if (total < kParallelThresholdBytes || at::get_num_threads() <= 1) {
    copy_byte_range(descs, offsets, 0, total, streaming);
  } else {
    const int64_t chunks = static_cast<int64_t>((total + kChunkBytes - 1) / kChunkBytes);
    at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
      copy_byte_range(descs, offsets, lo * kChunkBytes, std::min(total, hi * kChunkBytes), streaming);
      if (streaming) stream_fence();
    });
  }
  if (streaming) stream_fence();
}

// Copies every (layer, row) block of a validated call, the blocks split over torch's
// intra-op thread pool (at::parallel_for: torch.get_num_threads() threads). Each block's
// addresses are computed where it is copied, so nothing runs on one thread in
// proportion to the number of blocks (building a descriptor list first did, and that
// serial part is what kept 131k small blocks from scaling with cores). Adjacent blocks
// within a thread's share are merged into one memcpy.
void copy_layout(const BlockCopyLayout& layout) {
  const int64_t rows = layout.rows;
  const int64_t units = rows * static_cast<int64_t>(layout.layers.size());
  if (units == 0) return;
  size_t total = 0, largest = 0;
  for (const LayerCopy& l : layout.layers) {
    total += l.bytes * rows;
    largest = std::max(largest, l.bytes);
  }
  if (total == 0) return;
  const bool streaming = streaming_allowed() && total >= kStreamingThresholdBytes;
  const int64_t* m = layout.rows_ptr();
  auto copy_units = [&](int64_t lo, int64_t hi) {
    uintptr_t run_src = 0, run_dst = 0;
    size_t run_bytes = 0;
    auto flush = [&] {
      if (run_bytes == 0) return;
      auto* d = reinterpret_cast<char*>(run_dst);
      const auto* s = reinterpret_cast<const char*>(run_src);
      if (streaming) {
        stream_copy(d, s, run_bytes);
      } else {
        std::memcpy(d, s, run_bytes);
      }
      run_bytes = 0;
    };
    for (int64_t u = lo; u < hi; ++u) {
      const LayerCopy& l = layout.layers[static_cast<size_t>(u / rows)];
      const int64_t r = u % rows;
      const uintptr_t s = l.src_base + m[2 * r] * l.src_stride;
      const uintptr_t d = l.dst_base + m[2 * r + 1] * l.dst_stride;
      if (run_bytes != 0 && s == run_src + run_bytes && d == run_dst + run_bytes) {
        run_bytes += l.bytes;
        continue;
      }
      flush();
      run_src = s;
      run_dst = d;
      run_bytes = l.bytes;
    }
    flush();
    if (streaming) stream_fence();
  };
  if (total < kParallelThresholdBytes || at::get_num_threads() <= 1) {
    copy_units(0, units);
    return;
  }
  // Grain: about kChunkBytes per task, so thread wake-ups stay small next to the copy.
  const size_t avg = std::max<size_t>(1, total / static_cast<size_t>(units));
  const int64_t grain = static_cast<int64_t>(std::max<size_t>(1, kChunkBytes / avg));
  at::parallel_for(0, units, grain, copy_units);
}

void swap_blocks_batch_cpu(at::TensorList src, at::TensorList dst, const at::Tensor& mapping) {
  const BlockCopyLayout layout = validate_block_copies(src.vec(), dst.vec(), mapping);
  size_t largest = 0;
  for (const LayerCopy& l : layout.layers) largest = std::max(largest, l.bytes);
  if (largest > kChunkBytes) {
    // Blocks larger than a chunk: split by byte range, so a few huge blocks still
    // spread over every thread (a block per task would leave threads idle).
    CopyPlan plan = plan_block_copies(src.vec(), dst.vec(), mapping);
    parallel_memcpy(plan.descs);
    return;
  }
  copy_layout(layout);
}

// Raw addresses: a device backend claims them if they are its memory, else host memcpy.
void swap_blocks_batch_ptrs_cpu(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                                const at::Tensor& sizes) {
  std::vector<CopyDesc> descs = plan_ptr_copies(src_ptrs, dst_ptrs, sizes);
  if (descs.empty()) return;
  for (PtrCopier copier : ptr_copiers()) {
    if (copier(descs)) return;
  }
  parallel_memcpy(descs);
}

void record_layer_event_cpu(const at::Tensor& kv_cache, int64_t handle, int64_t layer) {
  pool_for_op(kv_cache, handle, layer);
}

void push_layer_cpu(const at::Tensor& kv_cache, int64_t handle, int64_t layer) {
  pool_for_op(kv_cache, handle, layer)->push(layer);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("swap_blocks_batch", &swap_blocks_batch_cpu);
  m.impl("swap_blocks_batch.ptrs", &swap_blocks_batch_ptrs_cpu);
  m.impl("record_layer_event", &record_layer_event_cpu);
  m.impl("push_layer", &push_layer_cpu);
}

}  // namespace kvops
