// CPU backend: parallel memcpy over merged descriptors, and trivially complete events.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../core/block_plan.h"
#include "../core/layer_events.h"

namespace kvops {
namespace {

// Below this a single thread wins: thread wake-up costs more than the copy.
constexpr size_t kParallelThresholdBytes = size_t{1} << 20;
constexpr size_t kChunkBytes = size_t{256} << 10;

// Copies the byte range [begin, end) of the concatenation of all descriptors, so a
// few huge blocks and many tiny ones split across threads equally well.
void copy_byte_range(const std::vector<CopyDesc>& descs, const std::vector<size_t>& offsets,
                     size_t begin, size_t end) {
  size_t k = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
  while (begin < end && k < descs.size()) {
    const size_t within = begin - offsets[k];
    const size_t n = std::min(descs[k].bytes - within, end - begin);
    std::memcpy(reinterpret_cast<void*>(descs[k].dst + within),
                reinterpret_cast<const void*>(descs[k].src + within), n);
    begin += n;
    ++k;
  }
}

void parallel_memcpy(const std::vector<CopyDesc>& descs) {
  std::vector<size_t> offsets(descs.size() + 1, 0);
  for (size_t k = 0; k < descs.size(); ++k) offsets[k + 1] = offsets[k] + descs[k].bytes;
  const size_t total = offsets.back();
  if (total < kParallelThresholdBytes || at::get_num_threads() <= 1) {
    for (const auto& d : descs) {
      std::memcpy(reinterpret_cast<void*>(d.dst), reinterpret_cast<const void*>(d.src), d.bytes);
    }
    return;
  }
  const int64_t chunks = static_cast<int64_t>((total + kChunkBytes - 1) / kChunkBytes);
  at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    copy_byte_range(descs, offsets, lo * kChunkBytes, std::min(total, hi * kChunkBytes));
  });
}

void swap_blocks_batch_cpu(at::TensorList src, at::TensorList dst, const at::Tensor& mapping) {
  CopyPlan plan = plan_block_copies(src.vec(), dst.vec(), mapping);
  parallel_memcpy(plan.descs);
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
