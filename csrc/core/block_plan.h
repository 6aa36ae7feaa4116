// Validation and descriptor planning for swap_blocks_batch, shared by every backend.
//
// A backend calls plan_block_copies() before touching memory: it either throws
// (naming the bad argument and value) or returns the full list of byte ranges to
// copy, with runs of adjacent blocks already merged. Nothing is copied on error.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace kvops {

struct CopyDesc {
  uintptr_t src;
  uintptr_t dst;
  size_t bytes;
};

struct CopyPlan {
  c10::Device src_device{c10::kCPU};
  c10::Device dst_device{c10::kCPU};
  std::vector<CopyDesc> descs;  // merged, in mapping order (layer-major)
  size_t total_bytes = 0;
};

// A validated call in its compact form: per layer, base addresses, strides of the block
// dimension and bytes per block; plus the mapping rows. Lets the CPU copy compute each
// block's addresses on the fly, in parallel, instead of building a descriptor list on
// one thread first.
struct LayerCopy {
  uintptr_t src_base;
  uintptr_t dst_base;
  size_t src_stride;  // bytes between blocks
  size_t dst_stride;
  size_t bytes;       // per block
};
struct BlockCopyLayout {
  c10::Device src_device{c10::kCPU};
  c10::Device dst_device{c10::kCPU};
  std::vector<LayerCopy> layers;
  at::Tensor mapping;  // contiguous [rows, 2] int64 (kept alive here)
  int64_t rows = 0;
  const int64_t* rows_ptr() const { return rows ? mapping.data_ptr<int64_t>() : nullptr; }
};

// Validates (src, dst, block_mapping) (everything plan_block_copies checks) and returns
// the compact layout; throws before any byte moves.
BlockCopyLayout validate_block_copies(const std::vector<at::Tensor>& src,
                                      const std::vector<at::Tensor>& dst,
                                      const at::Tensor& block_mapping);

// Validates (src, dst, block_mapping) and returns merged copy descriptors.
CopyPlan plan_block_copies(const std::vector<at::Tensor>& src,
                           const std::vector<at::Tensor>& dst,
                           const at::Tensor& block_mapping);

// Validates the raw (src_ptrs, dst_ptrs, sizes) form and returns its descriptors
// (adjacent ranges merged). Addresses themselves cannot be checked.
std::vector<CopyDesc> plan_ptr_copies(const at::Tensor& src_ptrs,
                                      const at::Tensor& dst_ptrs,
                                      const at::Tensor& sizes);

// Descriptors per driver call: very large batches crashed or hung drivers
// (vllm#49276), so backends submit in slices of at most this many.
constexpr size_t kMaxDescriptorsPerCall = 8192;

// Device-side copy engines (CUDA, NPU) register how they copy raw addresses so the
// CPU-dispatched .ptrs overload can route device pointers to them.
using PtrCopier = bool (*)(const std::vector<CopyDesc>& descs);
void register_ptr_copier(PtrCopier copier);
const std::vector<PtrCopier>& ptr_copiers();

}  // namespace kvops
