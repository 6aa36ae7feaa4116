// Which engine copies each descriptor on CUDA, and how the copy kernel's work is cut
// into launches. Pure C++ (no CUDA headers) so CPU CI tests every decision through
// torch_kvops._C._plan_cuda_copy; csrc/cuda only executes the plan.
//
// Why two engines (H100 figures in docs/benchmarks.md and FIELD-NOTES):
//   * A copy kernel (warps reading and writing device memory or pinned host memory
//     directly) reaches 0.92-0.96x of the PCIe link at 2-16 KiB descriptors and ~1x of
//     HBM for D2D, where DMA (cuMemcpyBatchAsync, or one cudaMemcpyAsync per copy on
//     the legacy stream) stays at 0.05-0.55x: DMA engines pay a per-descriptor cost.
//   * DMA reaches the link for merged runs >= 256 KiB without occupying any SM, and is
//     the only engine for pageable host memory (a kernel cannot address it) and for
//     copies between two GPUs (the kernel would need peer access).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "block_plan.h"
#include "copy_constants.h"

namespace kvops {

enum class CopyMode { kAuto = 0, kKernel = 1, kDma = 2 };

const char* copy_mode_name(CopyMode mode);
// Parses "auto" / "kernel" / "dma"; throws (naming `what`) on anything else.
CopyMode parse_copy_mode(const std::string& text, const char* what);

struct CopyPolicy {
  CopyMode mode = CopyMode::kAuto;
  // Host<->device descriptors of at least this many bytes go to DMA (auto mode): the
  // copy engines reach the link there and leave the SMs to the model.
  size_t dma_min_bytes = size_t{256} << 10;
  // Device->device: a per-copy DMA submission costs ~2 us of CPU while 256 KiB moves in
  // ~0.25 us at HBM speed, so DMA only pays off for much larger runs.
  size_t dma_min_bytes_d2d = size_t{16} << 20;
  // Upper bound on the copy kernel's grid (thread blocks of kKernelThreads threads).
  // The copy shares the GPU with the model: 128 blocks x 256 threads is the thread
  // count of 16 H100 SMs (12% of 132); in-flight bytes at that size are ~1-2 MiB,
  // above the PCIe bandwidth-delay product (~0.1 MiB). Raise it for D2D-heavy work.
  int max_ctas = 128;
};

// Process-wide policy: first read from the environment (KVOPS_CUDA_COPY,
// KVOPS_CUDA_COPY_MAX_CTAS, KVOPS_CUDA_DMA_MIN_BYTES, KVOPS_CUDA_DMA_MIN_BYTES_D2D);
// set_copy_policy replaces it (validated, thread-safe).
CopyPolicy copy_policy();
void set_copy_policy(const CopyPolicy& policy);
// Re-reads the environment (tests; a bad value throws and keeps the old policy).
CopyPolicy copy_policy_from_env();

enum class CopyPath : uint8_t { kKernel = 0, kDma = 1 };

// What the caller knows about the copy, besides the descriptors.
struct CopyContext {
  // Can a kernel on the launching device address every byte of the source / the
  // destination? (device memory of that device, or pinned host memory mapped at the
  // same address; false for pageable host memory and for another GPU's memory).
  bool src_kernel_ok = false;
  bool dst_kernel_ok = false;
  bool device_to_device = false;  // both sides device memory (threshold choice)
  bool capturing = false;         // stream capture: only by-value launches
  // DMA is one batch call (cuMemcpyBatchAsync). False on the legacy default stream (the
  // batch API refuses it) or without the driver entry point: there DMA is one
  // cudaMemcpyAsync per descriptor, and on an H200 the kernel beat that at every size
  // measured (256 KiB runs: 47.7 against 33.9 GB/s H2D). The legacy stream serializes
  // the copy with the model anyway, so the SMs the kernel takes are not the model's.
  bool dma_batched = true;
  bool large_params = true;       // 32 KiB kernel parameters usable
};

struct KernelLaunch {
  size_t first_item = 0;  // [first_item, first_item + items) of CudaCopyPlan::items
  size_t items = 0;
  int grid = 0;           // thread blocks
  bool by_value = true;   // items in kernel parameters; else uploaded (stream-ordered)
};

struct CudaCopyPlan {
  std::vector<CopyPath> path;         // per input descriptor
  std::vector<CopyDesc> items;        // kernel work items (descriptors cut at kKernelItemBytes)
  std::vector<KernelLaunch> launches;
  std::vector<CopyDesc> dma;          // descriptors for the DMA engine, in input order
  size_t kernel_bytes = 0;
  size_t dma_bytes = 0;
};

// Picks an engine per descriptor and cuts the kernel's share into launches:
//   * mode dma, or a side a kernel cannot address -> DMA (also in mode kernel: the
//     kernel would fault on pageable memory, which poisons the CUDA context);
//   * mode kernel -> kernel; mode auto -> DMA when bytes >= the threshold for the
//     direction, kernel otherwise;
//   * kernel items fit one by-value launch -> one launch; else while capturing ->
//     several by-value launches (parameters are copied into the graph, so nothing has
//     to stay alive for the graph's life); else one launch over an uploaded table.
//   * grid = min(ceil(items / warps per block), policy.max_ctas), at least 1.
CudaCopyPlan plan_cuda_copy(const std::vector<CopyDesc>& descs, const CopyContext& ctx,
                            const CopyPolicy& policy);

}  // namespace kvops
