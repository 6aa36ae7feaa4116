// Launchers of the block-copy kernel (copy_kernel.cu). No torch headers here: the
// kernel file compiles in seconds and its device code is not parsed with all of torch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvops {
namespace cuda_copy {

// One work item: `bytes` from `src` to `dst`, both addressable by the launching device
// (its memory, or pinned host memory mapped at the same address). Same layout as
// kvops::CopyDesc (static_assert in kvops_cuda.cu).
struct Item {
  uint64_t src;
  uint64_t dst;
  uint64_t bytes;
};

// Copies items[0, count) with `grid` blocks; the items travel in the kernel's
// parameters (copied at launch and into a captured graph node), so `items` may be
// freed on return. count <= kItemsByValueLarge (large_params) or kItemsByValueSmall.
cudaError_t launch_by_value(const Item* items, size_t count, int grid, bool large_params,
                            cudaStream_t stream);

// Copies device_items[0, count) (a table in device memory, written in stream order
// before this launch) with `grid` blocks.
cudaError_t launch_from_table(const Item* device_items, size_t count, int grid,
                              cudaStream_t stream);

}  // namespace cuda_copy
}  // namespace kvops
