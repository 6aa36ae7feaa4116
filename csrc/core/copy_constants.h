// Geometry of the CUDA copy kernel, shared by the planner (core/copy_policy.cpp, pure
// C++) and the kernel (cuda/copy_kernel.cu). No includes beyond <cstddef>: the kernel
// file must not parse torch's headers in its device passes.
#pragma once

#include <cstddef>

namespace kvops {

// Kernel geometry, shared with csrc/cuda/copy_kernel.cu.
constexpr int kKernelThreads = 256;
constexpr int kKernelWarpsPerCta = kKernelThreads / 32;
// One warp copies one work item; a descriptor larger than this is cut into items of
// this size (item starts keep the descriptor's alignment), so one big descriptor is
// spread over many warps instead of serialising on one.
constexpr size_t kKernelItemBytes = size_t{16} << 10;
// Work items per launch when they travel by value in kernel parameters (24 bytes each
// plus an 8-byte count): 4 KiB of parameters on any CUDA, 32 KiB from CUDA 12.1 on
// Volta and newer (runtime and driver both >= 12.1).
constexpr size_t kItemsByValueSmall = 168;   // 8 + 168 * 24 = 4040 bytes
constexpr size_t kItemsByValueLarge = 1360;  // 8 + 1360 * 24 = 32648 bytes (< 32764)

}  // namespace kvops
