// CUDA backend: batched block copies on the current stream, and per-layer events that
// work both eagerly and inside captured CUDA graphs.
//
// Copy engine (swap_blocks_batch and its .ptrs form). core/copy_policy.h picks, per
// merged descriptor, one of two engines (thresholds and why: docs/ops.md):
//   * The copy kernel (copy_kernel.cu): descriptors below the DMA threshold whose two
//     sides the kernel can address (memory of the launching GPU, or pinned host memory
//     mapped at the same address, checked with cudaPointerGetAttributes). Work items
//     reach the kernel in its parameters when they fit one launch (up to 1360 items
//     with 32 KiB parameters, CUDA >= 12.1; else 168); a larger eager batch is copied
//     into a pinned slot of a ring (PinnedRing, below) and uploaded with a
//     stream-ordered cudaMemcpyAsync into a buffer of torch's caching allocator, then
//     one kernel reads that table. While the stream is captured only by-value launches
//     are used (several if needed): their parameters are copied into the graph, so no
//     buffer has to outlive the call, and each replay copies the current bytes.
//   * DMA: large merged runs (the copy engines reach the link there without SMs),
//     pageable host memory and other GPUs' memory. The driver's cuMemcpyBatchAsync
//     (CUDA 12.8+), one call per slice of at most kMaxDescriptorsPerCall descriptors,
//     resolved at run time through cudaGetDriverEntryPointByVersion (neither libcuda
//     nor a recent driver is needed to load this library; CUDA 13 (no failIdx) and
//     12.8 (failIdx) ABIs both handled), source access order STREAM (ANY lets the DMA
//     read the source before earlier work on the stream wrote it, vllm#39306). One
//     cudaMemcpyAsync per descriptor when the stream is captured (the batch API cannot
//     be captured and silently drops the copy), on the legacy default stream (rejected
//     by the batch API), without the driver entry point, or after a refused batch call.
//   Kernel and DMA parts are issued on the same stream (kernel first). They serialise,
//   which costs nothing for host<->device copies: both are limited by the same link.
//   KVOPS_CUDA_COPY=auto|kernel|dma (or torch_kvops.set_copy_policy) forces a path;
//   KVOPS_DISABLE_CUDA_BATCH_MEMCPY=1 keeps DMA on per-copy cudaMemcpyAsync.
//
// Events: one cudaEvent_t per layer (timing disabled). While the stream is captured the
// record is an external record node (cudaEventRecordExternal), so the host can wait on
// it after every replay, and push_layer is a host node (cudaLaunchHostFunc) whose C++
// callback only appends to the pool's queue (a closed pool ignores it). Closing a pool
// keeps its device events alive (core/layer_events.cpp) because a captured graph may
// still record them on replay.
//
// This file holds host code only. Its body is skipped in nvcc's device passes
// (__CUDA_ARCH__ defined), which would otherwise parse all of torch's headers again for
// nothing: kernels live in copy_kernel.cu, which includes no torch header.
//
// Only c10/cuda headers are used (not ATen/cuda/CUDAContext.h, which pulls in cuBLAS and
// cuSPARSE headers), plus cuda.h for the driver types. Nothing here links libcuda.
#ifndef __CUDA_ARCH__

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstddef>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../core/block_plan.h"
#include "../core/copy_policy.h"
#include "../core/layer_events.h"
#include "copy_kernel.h"

// The batch API needs CUDA 12.8 types (cuda.h) and cudaGetDriverEntryPointByVersion
// (runtime 12.5+). Older toolkits build the per-copy engine only.
#if defined(CUDA_VERSION) && CUDA_VERSION >= 12080 && defined(CUDART_VERSION) && \
    CUDART_VERSION >= 12050
#define KVOPS_CUDA_HAVE_BATCH_API 1
#else
#define KVOPS_CUDA_HAVE_BATCH_API 0
#endif

// Checks a runtime call; on failure clears the thread's last-error slot (so an unrelated
// later torch check does not trip over it) and raises with the call and the context.
#define KVOPS_CUDA_CHECK(expr, ...)                                                    \
  do {                                                                                 \
    const cudaError_t kvops_err_ = (expr);                                             \
    if (kvops_err_ != cudaSuccess) {                                                   \
      (void)cudaGetLastError();                                                        \
      TORCH_CHECK(false, __VA_ARGS__, ": ", #expr, " failed with ",                    \
                  cudaGetErrorName(kvops_err_), " (", cudaGetErrorString(kvops_err_),  \
                  ")");                                                                \
    }                                                                                  \
  } while (0)

namespace kvops {
namespace {

// ---------------------------------------------------------------------------------
// Driver entry point for cuMemcpyBatchAsync.

#if KVOPS_CUDA_HAVE_BATCH_API
// Our own typedefs: the prototypes in cuda.h are for one ABI only, and cuda.h maps the
// name to _v2 on CUDA 13 headers.
using MemcpyBatchV13Fn = CUresult(CUDAAPI*)(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes,
                                            size_t count, CUmemcpyAttributes* attrs,
                                            size_t* attrsIdxs, size_t numAttrs,
                                            CUstream hStream);
using MemcpyBatchV12Fn = CUresult(CUDAAPI*)(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes,
                                            size_t count, CUmemcpyAttributes* attrs,
                                            size_t* attrsIdxs, size_t numAttrs, size_t* failIdx,
                                            CUstream hStream);

struct BatchEntry {
  MemcpyBatchV13Fn v13 = nullptr;
  MemcpyBatchV12Fn v12 = nullptr;
  bool available() const { return v13 != nullptr || v12 != nullptr; }
};

void* lookup_driver_symbol(const char* name, unsigned int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &status);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return status == cudaDriverEntryPointSuccess ? fn : nullptr;
}

BatchEntry resolve_batch_entry() {
  BatchEntry entry;
  const char* off = std::getenv("KVOPS_DISABLE_CUDA_BATCH_MEMCPY");
  if (off != nullptr && std::strcmp(off, "1") == 0) return entry;
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    (void)cudaGetLastError();
    return entry;
  }
  // The driver hands back the newest version of a symbol not above the requested one:
  // asking a 12.x driver for "13000" would return the 12.8 ABI (with failIdx). So the
  // ABI is chosen by the driver's own version, never by what we asked for.
  if (driver >= 13000) {
    entry.v13 = reinterpret_cast<MemcpyBatchV13Fn>(lookup_driver_symbol("cuMemcpyBatchAsync", 13000));
  }
  if (!entry.available() && driver >= 12080) {
    entry.v12 = reinterpret_cast<MemcpyBatchV12Fn>(lookup_driver_symbol("cuMemcpyBatchAsync", 12080));
  }
  return entry;
}

const BatchEntry& batch_entry() {
  static const BatchEntry entry = resolve_batch_entry();  // thread-safe, resolved once
  return entry;
}
#endif  // KVOPS_CUDA_HAVE_BATCH_API

// ---------------------------------------------------------------------------------
// Copy engine.

// Where one side of a copy lives: a CUDA device ordinal, or kHost.
constexpr int kHost = -1;

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  KVOPS_CUDA_CHECK(cudaStreamIsCapturing(stream, &status),
                   "kvops: cannot query the capture status of the current stream");
  // An invalidated capture counts as capturing: the next captured call reports it.
  return status != cudaStreamCaptureStatusNone;
}

bool is_legacy_default_stream(cudaStream_t stream) {
  return stream == nullptr || stream == cudaStreamLegacy;
}

std::string hex_address(uintptr_t address) {
  char buf[2 + 2 * sizeof(uintptr_t) + 1];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(address));
  return buf;
}

void copy_one_by_one(const CopyDesc* descs, size_t count, size_t first_index,
                     cudaStream_t stream) {
  for (size_t k = 0; k < count; ++k) {
    const CopyDesc& d = descs[k];
    KVOPS_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<void*>(d.dst),
                                     reinterpret_cast<const void*>(d.src), d.bytes,
                                     cudaMemcpyDefault, stream),
                     "kvops: copy ", first_index + k, " (", d.bytes, " bytes from ",
                     hex_address(d.src), " to ", hex_address(d.dst), ") could not be issued");
  }
}

#if KVOPS_CUDA_HAVE_BATCH_API
CUmemLocation location_hint(int where) {
  CUmemLocation loc;
  std::memset(&loc, 0, sizeof(loc));
  if (where == kHost) {
    loc.type = CU_MEM_LOCATION_TYPE_HOST;
    loc.id = 0;
  } else {
    loc.type = CU_MEM_LOCATION_TYPE_DEVICE;
    loc.id = where;
  }
  return loc;
}

// One batched submission; false (nothing to clean up) when the driver refuses it.
bool copy_batched(const BatchEntry& entry, const CopyDesc* descs, size_t count, int src_where,
                  int dst_where, cudaStream_t stream, std::vector<CUdeviceptr>& srcs,
                  std::vector<CUdeviceptr>& dsts, std::vector<size_t>& sizes) {
  srcs.resize(count);
  dsts.resize(count);
  sizes.resize(count);
  for (size_t k = 0; k < count; ++k) {
    srcs[k] = static_cast<CUdeviceptr>(descs[k].src);
    dsts[k] = static_cast<CUdeviceptr>(descs[k].dst);
    sizes[k] = descs[k].bytes;
  }
  CUmemcpyAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;  // never ANY (vllm#39306)
  attr.srcLocHint = location_hint(src_where);
  attr.dstLocHint = location_hint(dst_where);
  attr.flags = 0;
  size_t attr_idx = 0;
  size_t fail_idx = 0;
  const auto cu_stream = reinterpret_cast<CUstream>(stream);
  CUresult res;
  if (entry.v13 != nullptr) {
    res = entry.v13(dsts.data(), srcs.data(), sizes.data(), count, &attr, &attr_idx, 1, cu_stream);
  } else {
    res = entry.v12(dsts.data(), srcs.data(), sizes.data(), count, &attr, &attr_idx, 1, &fail_idx,
                    cu_stream);
  }
  if (res == CUDA_SUCCESS) return true;
  TORCH_WARN_ONCE("kvops: cuMemcpyBatchAsync failed with CUresult ", static_cast<int>(res),
                  " (", count, " copies",
                  entry.v12 != nullptr ? ", failIdx " + std::to_string(fail_idx) : std::string(),
                  "); falling back to one cudaMemcpyAsync per copy. "
                  "Further failures are not reported.");
  return false;
}
#endif  // KVOPS_CUDA_HAVE_BATCH_API

// Whether DMA on `stream` is one batch call, rather than one cudaMemcpyAsync per copy.
bool dma_is_batched(cudaStream_t stream) {
#if KVOPS_CUDA_HAVE_BATCH_API
  return batch_entry().available() && !is_legacy_default_stream(stream);
#else
  (void)stream;
  return false;
#endif
}

// Issues every descriptor on `stream`, in slices of kMaxDescriptorsPerCall.
// src_where / dst_where: device ordinal or kHost, used as location hints only.
void copy_on_stream(const std::vector<CopyDesc>& descs, cudaStream_t stream, int src_where,
                    int dst_where) {
  if (descs.empty()) return;
#if KVOPS_CUDA_HAVE_BATCH_API
  const BatchEntry& entry = batch_entry();
  bool batched = dma_is_batched(stream) && !stream_is_capturing(stream);
  std::vector<CUdeviceptr> srcs, dsts;
  std::vector<size_t> sizes;
#else
  (void)src_where;
  (void)dst_where;
#endif
  for (size_t begin = 0; begin < descs.size(); begin += kMaxDescriptorsPerCall) {
    const size_t count = std::min(kMaxDescriptorsPerCall, descs.size() - begin);
#if KVOPS_CUDA_HAVE_BATCH_API
    if (batched) {
      if (copy_batched(entry, descs.data() + begin, count, src_where, dst_where, stream, srcs,
                       dsts, sizes)) {
        continue;
      }
      batched = false;  // a refused slice will be refused again: go copy by copy
    }
#endif
    copy_one_by_one(descs.data() + begin, count, begin, stream);
  }
}

int where_of(c10::Device device) {
  return device.is_cuda() ? static_cast<int>(device.index()) : kHost;
}

// ---------------------------------------------------------------------------------
// Address classification.

// Device ordinal of device / managed memory, kHost for host memory (pageable, or
// pinned). `known` is false when CUDA could not classify the address. `kernel_ok`: a
// kernel on device `where` (for host memory: on any device) can dereference the
// address as it is: device or managed memory, or pinned host memory whose device
// pointer equals its host pointer (cudaHostAlloc memory under unified addressing; not
// always memory registered with cudaHostRegister). Pageable memory is never kernel_ok.
struct AddressKind {
  int where = kHost;
  bool known = false;
  bool kernel_ok = false;
};

AddressKind classify_address(uintptr_t address) {
  cudaPointerAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(address)) != cudaSuccess) {
    (void)cudaGetLastError();  // must not leak into a later, unrelated torch check
    return {kHost, false, false};
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
    return {attr.device, true, true};
  }
  if (attr.type == cudaMemoryTypeHost) {
    return {kHost, true, reinterpret_cast<uintptr_t>(attr.devicePointer) == address};
  }
  return {kHost, true, false};  // cudaMemoryTypeUnregistered: pageable
}

// Can a kernel on `device` address this side? Device memory must be that device's own
// (another GPU's needs peer access: left to DMA); host memory must be kernel_ok.
bool side_kernel_ok(const AddressKind& kind, int device) {
  if (!kind.known || !kind.kernel_ok) return false;
  return kind.where == kHost || kind.where == device;
}

bool tensors_kernel_ok(at::TensorList tensors, int device) {
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;  // contributes no descriptor
    if (t.is_cuda()) {
      if (t.device().index() != device) return false;
      continue;
    }
    if (!side_kernel_ok(classify_address(reinterpret_cast<uintptr_t>(t.data_ptr())), device)) {
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------
// Copy kernel: launch parameters and the descriptor upload for large eager batches.

static_assert(sizeof(CopyDesc) == sizeof(cuda_copy::Item) &&
                  offsetof(CopyDesc, src) == offsetof(cuda_copy::Item, src) &&
                  offsetof(CopyDesc, dst) == offsetof(cuda_copy::Item, dst) &&
                  offsetof(CopyDesc, bytes) == offsetof(cuda_copy::Item, bytes),
              "CopyDesc and cuda_copy::Item must share one layout");

const cuda_copy::Item* as_items(const CopyDesc* descs) {
  return reinterpret_cast<const cuda_copy::Item*>(descs);
}

// 32 KiB kernel parameters need CUDA 12.1 in both the runtime we were built with and
// the driver (and Volta or newer, which every architecture nvcc 12/13 targets is).
bool large_kernel_params() {
  static const bool ok = [] {
#if CUDART_VERSION >= 12010
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return driver >= 12010;
#else
    return false;
#endif
  }();
  return ok;
}

// Switches the calling thread to relaxed capture mode for its lifetime: the ring below
// may allocate pinned memory and wait on an event, which in the default global mode
// would invalidate a graph another thread is capturing.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() {
    KVOPS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode_),
                     "kvops: cannot switch this thread to relaxed capture mode");
  }
  ~RelaxedCaptureMode() {
    if (cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) (void)cudaGetLastError();
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Pinned staging slots for descriptor tables, one ring per device. A slot is written by
// the host, uploaded with cudaMemcpyAsync on the caller's stream, and guarded by an
// event recorded right after that upload: it is rewritten only once the event has
// completed, so the host never overwrites bytes the copy engine has not read yet. With
// kSlots slots the host waits only if it runs kSlots large batches ahead of the GPU.
// Never used under capture (a captured upload would read the slot on every replay).
// The slots live until process exit: freeing pinned memory at static destruction
// races the CUDA runtime's own teardown.
class PinnedRing {
 public:
  static PinnedRing& for_device(int device) {
    // Never destroyed: a daemon sender thread may still upload during process exit.
    static auto* registry_mutex = new std::mutex();
    static auto* rings_ptr = new std::vector<std::unique_ptr<PinnedRing>>();
    auto& rings = *rings_ptr;
    std::lock_guard<std::mutex> lock(*registry_mutex);
    if (rings.size() <= static_cast<size_t>(device)) rings.resize(device + 1);
    if (!rings[device]) rings[device].reset(new PinnedRing());
    return *rings[device];
  }

  // Enqueues on `stream` (current device = the ring's device) the upload of
  // items[0, count) into device_table.
  void upload(const CopyDesc* items, size_t count, void* device_table, cudaStream_t stream) {
    const size_t bytes = count * sizeof(CopyDesc);
    std::lock_guard<std::mutex> lock(mutex_);
    Slot& slot = slots_[next_];
    next_ = (next_ + 1) % kSlots;
    RelaxedCaptureMode relaxed;
    if (slot.event == nullptr) {
      KVOPS_CUDA_CHECK(cudaEventCreateWithFlags(&slot.event, cudaEventDisableTiming),
                       "kvops: cannot create the event of a descriptor upload slot");
    }
    if (slot.pending) {
      KVOPS_CUDA_CHECK(cudaEventSynchronize(slot.event),
                       "kvops: waiting for an earlier descriptor upload failed");
      slot.pending = false;
    }
    if (slot.capacity < bytes) {
      if (slot.host != nullptr) {
        KVOPS_CUDA_CHECK(cudaFreeHost(slot.host), "kvops: cannot free a descriptor upload slot");
        slot.host = nullptr;
        slot.capacity = 0;
      }
      size_t capacity = size_t{64} << 10;
      while (capacity < bytes) capacity *= 2;
      KVOPS_CUDA_CHECK(cudaHostAlloc(&slot.host, capacity, cudaHostAllocDefault),
                       "kvops: cannot allocate ", capacity,
                       " bytes of pinned memory for the copy kernel's descriptor table");
      slot.capacity = capacity;
    }
    std::memcpy(slot.host, items, bytes);
    KVOPS_CUDA_CHECK(cudaMemcpyAsync(device_table, slot.host, bytes, cudaMemcpyHostToDevice, stream),
                     "kvops: cannot upload ", count, " copy descriptors");
    const cudaError_t rec = cudaEventRecord(slot.event, stream);
    if (rec != cudaSuccess) {
      // The upload is queued but unguarded: abandon (leak) the slot rather than let a
      // later call overwrite bytes the copy engine may not have read.
      slot.host = nullptr;
      slot.capacity = 0;
      KVOPS_CUDA_CHECK(rec, "kvops: cannot record the event guarding a descriptor upload");
    }
    slot.pending = true;
  }

 private:
  static constexpr size_t kSlots = 8;
  struct Slot {
    void* host = nullptr;
    size_t capacity = 0;
    cudaEvent_t event = nullptr;
    bool pending = false;
  };
  std::mutex mutex_;
  std::array<Slot, kSlots> slots_{};
  size_t next_ = 0;
};

// Runs the copy plan's kernel launches on `stream` (current device = `device`).
void run_kernel_launches(const CudaCopyPlan& plan, int device, cudaStream_t stream,
                         bool large_params) {
  for (const KernelLaunch& launch : plan.launches) {
    const CopyDesc* first = plan.items.data() + launch.first_item;
    if (launch.by_value) {
      KVOPS_CUDA_CHECK(cuda_copy::launch_by_value(as_items(first), launch.items, launch.grid,
                                                  large_params, stream),
                       "kvops: copy kernel launch (", launch.items, " items, ", launch.grid,
                       " blocks) failed");
      continue;
    }
    // Stream-ordered: torch's caching allocator hands this block to a later allocation
    // on the same stream only, i.e. after this kernel, so it may be freed on return.
    const size_t bytes = launch.items * sizeof(CopyDesc);
    // The allocation may cudaMalloc: relaxed, so that a connector thread copying while
    // another thread captures a graph in global mode does not invalidate that capture.
    RelaxedCaptureMode relaxed;
    c10::DataPtr table = c10::cuda::CUDACachingAllocator::get()->allocate(bytes);
    PinnedRing::for_device(device).upload(first, launch.items, table.get(), stream);
    KVOPS_CUDA_CHECK(
        cuda_copy::launch_from_table(static_cast<const cuda_copy::Item*>(table.get()),
                                     launch.items, launch.grid, stream),
        "kvops: copy kernel launch (", launch.items, " uploaded items, ", launch.grid,
        " blocks) failed");
  }
}

// Copies `descs` on `stream` of `device` (already current): the kernel's share first,
// then the DMA share.
void copy_descs(const std::vector<CopyDesc>& descs, int device, cudaStream_t stream,
                bool src_kernel_ok, bool dst_kernel_ok, int src_where, int dst_where) {
  if (descs.empty()) return;
  CopyContext ctx;
  ctx.src_kernel_ok = src_kernel_ok;
  ctx.dst_kernel_ok = dst_kernel_ok;
  ctx.device_to_device = src_where != kHost && dst_where != kHost;
  ctx.large_params = large_kernel_params();
  ctx.dma_batched = dma_is_batched(stream);
  const CopyPolicy policy = copy_policy();
  const bool any_kernel = policy.mode != CopyMode::kDma && src_kernel_ok && dst_kernel_ok;
  // Only a plan that may launch kernels needs to know about capture.
  ctx.capturing = any_kernel && stream_is_capturing(stream);
  const CudaCopyPlan plan = plan_cuda_copy(descs, ctx, policy);
  run_kernel_launches(plan, device, stream, ctx.large_params);
  copy_on_stream(plan.dma, stream, src_where, dst_where);
}

void swap_blocks_batch_cuda(at::TensorList src, at::TensorList dst, const at::Tensor& mapping) {
  // Validates everything (including the CUDA<->CUDA / CUDA<->CPU pair) before any copy.
  CopyPlan plan = plan_block_copies(src.vec(), dst.vec(), mapping);
  if (plan.descs.empty()) return;
  const c10::Device device = plan.dst_device.is_cuda() ? plan.dst_device : plan.src_device;
  TORCH_CHECK(device.is_cuda() && device.has_index(),
              "swap_blocks_batch: CUDA kernel called without a CUDA tensor (src on ",
              plan.src_device, ", dst on ", plan.dst_device, ")");
  c10::cuda::CUDAGuard guard(device);
  // Ordered on the current stream of dst's device (src's for device-to-host). A copy
  // from another GPU is not ordered after that GPU's streams: synchronize them first.
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const int dev = static_cast<int>(device.index());
  // Host sides are classified per layer tensor: one pageable layer sends that whole
  // side to DMA (rare; a kernel touching pageable memory would fault the context).
  const CopyPolicy policy = copy_policy();
  const bool want_kernel = policy.mode != CopyMode::kDma;
  const bool src_ok = want_kernel && tensors_kernel_ok(src, dev);
  const bool dst_ok = want_kernel && src_ok && tensors_kernel_ok(dst, dev);
  copy_descs(plan.descs, dev, stream, src_ok, dst_ok, where_of(plan.src_device),
             where_of(plan.dst_device));
}

// ---------------------------------------------------------------------------------
// Raw addresses (.ptrs). The CPU kernel dispatches the op (its tensors live on the CPU)
// and asks this copier first.

// A device whose primary context exists (the current one preferred), or -1 if none.
int device_with_context() {
  try {
    const c10::DeviceIndex current = c10::cuda::current_device();
    if (c10::cuda::hasPrimaryContext(current)) return current;
    const c10::DeviceIndex n = c10::cuda::device_count();
    for (c10::DeviceIndex i = 0; i < n; ++i) {
      if (c10::cuda::hasPrimaryContext(i)) return i;
    }
    return -1;
  } catch (const c10::Error&) {
    return -1;  // no usable driver / device: there is no CUDA memory to copy
  }
}

// All addresses of one call must be of one kind pair (e.g. all device->pinned host):
// the first and the last descriptor are inspected. A call whose two sides are both
// known host memory is left to the CPU memcpy (returns false). Anything else, device
// memory on either side or an address CUDA could not classify, is copied on the
// current stream of the device that owns the destination (the source's, for
// device->host), which is the current device in the usual one-GPU-per-process setup;
// returns true. The kernel is used only where every inspected address of a side is
// kernel-addressable on that device; everything else goes to DMA (cudaMemcpyDefault
// semantics, correct for any pair).
bool cuda_ptr_copier(const std::vector<CopyDesc>& descs) {
  if (descs.empty()) return false;
  // No primary context anywhere: no CUDA allocation can exist, and querying would
  // create a context (hundreds of MB of device memory) for a host-only copy. The queries
  // run on a device that already has one, so they never create a context either.
  const int queried_on = device_with_context();
  if (queried_on < 0) return false;
  AddressKind src, dst, src_last, dst_last;
  {
    c10::cuda::CUDAGuard query_guard(static_cast<c10::DeviceIndex>(queried_on));
    src = classify_address(descs.front().src);
    dst = classify_address(descs.front().dst);
    src_last = descs.size() > 1 ? classify_address(descs.back().src) : src;
    dst_last = descs.size() > 1 ? classify_address(descs.back().dst) : dst;
  }
  if (src.known && dst.known && src.where == kHost && dst.where == kHost) return false;
  const int owner = dst.where != kHost ? dst.where : src.where != kHost ? src.where : queried_on;
  const auto index = static_cast<c10::DeviceIndex>(owner);
  c10::cuda::CUDAGuard guard(index);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index).stream();
  const bool src_ok = side_kernel_ok(src, owner) && side_kernel_ok(src_last, owner) &&
                      src_last.where == src.where;
  const bool dst_ok = side_kernel_ok(dst, owner) && side_kernel_ok(dst_last, owner) &&
                      dst_last.where == dst.where;
  copy_descs(descs, owner, stream, src_ok, dst_ok, src.where, dst.where);
  return true;
}

// Reached only when an argument of .ptrs is a CUDA tensor, which plan_ptr_copies
// rejects with a message naming it (addresses must be given as CPU int64 tensors).
void swap_blocks_batch_ptrs_cuda(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                                 const at::Tensor& sizes) {
  std::vector<CopyDesc> descs = plan_ptr_copies(src_ptrs, dst_ptrs, sizes);
  if (descs.empty()) return;
  TORCH_CHECK(cuda_ptr_copier(descs),
              "swap_blocks_batch.ptrs: the CUDA kernel only copies device memory; host-to-host "
              "copies go through CPU argument tensors");
}

// ---------------------------------------------------------------------------------
// Layer events.

class CudaLayerEvents final : public DeviceEvents {
 public:
  CudaLayerEvents(int64_t num_layers, c10::Device device) : device_(device) {
    TORCH_CHECK(device.is_cuda() && device.has_index(),
                "LayerEvents: CUDA events need a device with an index (e.g. cuda:0), got ",
                device);
    c10::cuda::CUDAGuard guard(device);
    events_.assign(static_cast<size_t>(num_layers), nullptr);
    for (size_t i = 0; i < events_.size(); ++i) {
      const cudaError_t err = cudaEventCreateWithFlags(&events_[i], cudaEventDisableTiming);
      if (err != cudaSuccess) {
        events_[i] = nullptr;
        destroy_all();
        (void)cudaGetLastError();
        TORCH_CHECK(false, "LayerEvents: cudaEventCreateWithFlags failed for layer ", i, " of ",
                    num_layers, " on ", device, ": ", cudaGetErrorName(err), " (",
                    cudaGetErrorString(err), ")");
      }
    }
  }

  ~CudaLayerEvents() override { destroy_all(); }

  CudaLayerEvents(const CudaLayerEvents&) = delete;
  CudaLayerEvents& operator=(const CudaLayerEvents&) = delete;

  cudaEvent_t event(int64_t layer) const {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(events_.size()), "LayerEvents: layer ",
                layer, " is out of range (", events_.size(), " layers)");
    return events_[static_cast<size_t>(layer)];
  }

  // Called from sender threads, possibly while another thread captures a graph in the
  // default global mode: a query from a thread in global mode would invalidate that
  // capture, so this thread switches to relaxed mode around it.
  bool query(int64_t layer) override {
    const cudaEvent_t ev = event(layer);
    // A sender thread starts on device 0: without the guard the query would create a
    // context on GPU 0 in every process whose caches live on another GPU.
    c10::cuda::CUDAGuard guard(device_);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    KVOPS_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode),
                     "LayerEvents: cannot switch this thread to relaxed capture mode");
    const cudaError_t err = cudaEventQuery(ev);
    cudaStreamCaptureMode previous = mode;
    const cudaError_t restore = cudaThreadExchangeStreamCaptureMode(&previous);
    if (err != cudaSuccess && err != cudaErrorNotReady) {
      (void)cudaGetLastError();
      TORCH_CHECK(false, "LayerEvents: cudaEventQuery failed for layer ", layer, " on ", device_,
                  ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
    }
    KVOPS_CUDA_CHECK(restore, "LayerEvents: cannot restore this thread's capture mode");
    return err == cudaSuccess;
  }

 private:
  void destroy_all() noexcept {
    bool failed = false;
    for (cudaEvent_t& ev : events_) {
      // Errors are ignored: at interpreter exit the driver may already be shut down.
      if (ev != nullptr && cudaEventDestroy(ev) != cudaSuccess) failed = true;
      ev = nullptr;
    }
    if (failed) (void)cudaGetLastError();
  }

  const c10::Device device_;
  std::vector<cudaEvent_t> events_;
};

CudaLayerEvents& cuda_events_of(const LayerEventPool& pool) {
  auto* events = dynamic_cast<CudaLayerEvents*>(pool.events());
  TORCH_CHECK(events != nullptr, "LayerEvents: handle ", pool.handle(), " on ", pool.device(),
              " has no CUDA events");
  return *events;
}

void record_layer_event_cuda(const at::Tensor& kv_cache, int64_t handle, int64_t layer) {
  auto pool = pool_for_op(kv_cache, handle, layer);  // device, range and binding checks
  const cudaEvent_t ev = cuda_events_of(*pool).event(layer);
  const c10::Device device = kv_cache.device();
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  if (stream_is_capturing(stream)) {
    // A plain record during capture cannot be waited on from the host after replay; an
    // external record node fires on every replay.
    KVOPS_CUDA_CHECK(cudaEventRecordWithFlags(ev, stream, cudaEventRecordExternal),
                     "record_layer_event: cannot capture the record of layer ", layer,
                     " (handle ", handle, ")");
  } else {
    KVOPS_CUDA_CHECK(cudaEventRecord(ev, stream), "record_layer_event: cannot record layer ",
                     layer, " (handle ", handle, ")");
  }
}

// Host node callback: runs on a CUDA driver thread on every replay. Must not call CUDA
// and must not throw (nothing can catch it there).
void CUDART_CB push_layer_host_callback(void* packed) {
  try {
    push_packed_target(packed);
  } catch (...) {
  }
}

void push_layer_cuda(const at::Tensor& kv_cache, int64_t handle, int64_t layer) {
  auto pool = pool_for_op(kv_cache, handle, layer);  // device, range and binding checks
  const c10::Device device = kv_cache.device();
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  if (stream_is_capturing(stream)) {
    KVOPS_CUDA_CHECK(cudaLaunchHostFunc(stream, &push_layer_host_callback,
                                        pack_push_target(handle, layer)),
                     "push_layer: cannot capture the push of layer ", layer, " (handle ", handle,
                     ")");
  } else {
    pool->push(layer);
  }
}

struct CudaBackendRegistrar {
  CudaBackendRegistrar() {
    register_ptr_copier(&cuda_ptr_copier);
    register_device_events_factory(c10::DeviceType::CUDA,
                                   [](int64_t num_layers, c10::Device device) {
                                     return std::unique_ptr<DeviceEvents>(
                                         new CudaLayerEvents(num_layers, device));
                                   });
  }
};
const CudaBackendRegistrar cuda_backend_registrar;

}  // namespace

// ---------------------------------------------------------------------------------
// Benchmark baselines (torch_kvops._C._bench_*), written as the engines write them:
// no merging of adjacent descriptors, no validation beyond the argument tensors' form.
// Both issue on the current stream of the current device and return the host
// submission time in seconds (the caller times completion with CUDA events).

namespace {
struct RawDescs {
  std::vector<CopyDesc> descs;
};

RawDescs raw_descs(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes) {
  // plan_ptr_copies validates the form; its merged output is not what an engine submits.
  (void)plan_ptr_copies(src_ptrs, dst_ptrs, sizes);
  const at::Tensor s = src_ptrs.contiguous(), d = dst_ptrs.contiguous(), n = sizes.contiguous();
  RawDescs out;
  out.descs.resize(static_cast<size_t>(n.numel()));
  for (int64_t k = 0; k < n.numel(); ++k) {
    out.descs[k] = {static_cast<uintptr_t>(s.data_ptr<int64_t>()[k]),
                    static_cast<uintptr_t>(d.data_ptr<int64_t>()[k]),
                    static_cast<size_t>(n.data_ptr<int64_t>()[k])};
  }
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

double bench_memcpy_loop(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                         const at::Tensor& sizes) {
  const RawDescs raw = raw_descs(src_ptrs, dst_ptrs, sizes);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto t0 = std::chrono::steady_clock::now();
  copy_one_by_one(raw.descs.data(), raw.descs.size(), 0, stream);
  return seconds_since(t0);
}

double bench_memcpy_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                          const at::Tensor& sizes) {
#if KVOPS_CUDA_HAVE_BATCH_API
  const RawDescs raw = raw_descs(src_ptrs, dst_ptrs, sizes);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const BatchEntry& entry = batch_entry();
  TORCH_CHECK(entry.available(), "_bench_memcpy_batch: the driver has no cuMemcpyBatchAsync");
  TORCH_CHECK(!is_legacy_default_stream(stream),
              "_bench_memcpy_batch: cuMemcpyBatchAsync refuses the legacy default stream; "
              "run it on a side stream");
  if (raw.descs.empty()) return 0.0;
  AddressKind src, dst;
  src = classify_address(raw.descs.front().src);
  dst = classify_address(raw.descs.front().dst);
  std::vector<CUdeviceptr> srcs, dsts;
  std::vector<size_t> lens;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t begin = 0; begin < raw.descs.size(); begin += kMaxDescriptorsPerCall) {
    const size_t count = std::min(kMaxDescriptorsPerCall, raw.descs.size() - begin);
    TORCH_CHECK(copy_batched(entry, raw.descs.data() + begin, count, src.where, dst.where, stream,
                             srcs, dsts, lens),
                "_bench_memcpy_batch: cuMemcpyBatchAsync failed");
  }
  return seconds_since(t0);
#else
  TORCH_CHECK(false, "_bench_memcpy_batch: built without the CUDA 12.8 batch API");
#endif
}

TORCH_LIBRARY_IMPL(kvops, CUDA, m) {
  m.impl("swap_blocks_batch", &swap_blocks_batch_cuda);
  m.impl("swap_blocks_batch.ptrs", &swap_blocks_batch_ptrs_cuda);
  m.impl("record_layer_event", &record_layer_event_cuda);
  m.impl("push_layer", &push_layer_cuda);
}

}  // namespace kvops

#endif  // __CUDA_ARCH__
