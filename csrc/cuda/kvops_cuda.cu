// CUDA backend: batched block copies on the current stream, and per-layer events that
// work both eagerly and inside captured CUDA graphs.
//
// Copy engine (swap_blocks_batch and its .ptrs form):
//   * Fast path: the driver's cuMemcpyBatchAsync (CUDA 12.8+), one call per slice of at
//     most kMaxDescriptorsPerCall merged descriptors. It is resolved at run time through
//     cudaGetDriverEntryPointByVersion, so neither libcuda nor a recent driver is needed
//     to load this library, and the CUDA 13 (no failIdx) and 12.8 (failIdx) ABIs are
//     both handled. Source access order is always STREAM: ANY lets the DMA read the
//     source before earlier work on the stream finished writing it (vllm#39306).
//   * Fallback: one cudaMemcpyAsync(cudaMemcpyDefault) per descriptor when the stream is
//     being captured (the batch API cannot be captured and silently drops the copy),
//     when the stream is the legacy default stream (rejected by the batch API), when the
//     driver has no batch entry point, or when a batch call fails (re-issuing a slice
//     copy by copy is idempotent: same bytes, same stream order).
//   Setting KVOPS_DISABLE_CUDA_BATCH_MEMCPY=1 forces the fallback (debugging aid).
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
// nothing: put any future __global__ kernel outside the #ifndef below.
//
// Only c10/cuda headers are used (not ATen/cuda/CUDAContext.h, which pulls in cuBLAS and
// cuSPARSE headers), plus cuda.h for the driver types. Nothing here links libcuda.
#ifndef __CUDA_ARCH__

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/block_plan.h"
#include "../core/layer_events.h"

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

// Issues every descriptor on `stream`, in slices of kMaxDescriptorsPerCall.
// src_where / dst_where: device ordinal or kHost, used as location hints only.
void copy_on_stream(const std::vector<CopyDesc>& descs, cudaStream_t stream, int src_where,
                    int dst_where) {
  if (descs.empty()) return;
#if KVOPS_CUDA_HAVE_BATCH_API
  const BatchEntry& entry = batch_entry();
  bool batched = entry.available() && !is_legacy_default_stream(stream) &&
                 !stream_is_capturing(stream);
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
  copy_on_stream(plan.descs, stream, where_of(plan.src_device), where_of(plan.dst_device));
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

// Device ordinal of device / managed memory, kHost for host memory (pageable, or pinned:
// a host->host copy is a host memcpy either way). `known` is false when CUDA could not
// classify the address.
struct AddressKind {
  int where = kHost;
  bool known = false;
};

AddressKind classify_address(uintptr_t address) {
  cudaPointerAttributes attr;
  std::memset(&attr, 0, sizeof(attr));
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(address)) != cudaSuccess) {
    (void)cudaGetLastError();  // must not leak into a later, unrelated torch check
    return {kHost, false};
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
    return {attr.device, true};
  }
  return {kHost, true};  // cudaMemoryTypeUnregistered or cudaMemoryTypeHost
}

// All addresses of one call must be of one kind pair (e.g. all device->host): only the
// first descriptor is inspected. A call whose two sides are both known host memory is
// left to the CPU memcpy (returns false). Anything else, device memory on either side
// or an address CUDA could not classify, is copied with cudaMemcpyDefault semantics
// (correct for any pair) on the current stream of the device that owns the destination
// (the source's, for device->host), which is the current device in the usual
// one-GPU-per-process setup; returns true.
bool cuda_ptr_copier(const std::vector<CopyDesc>& descs) {
  if (descs.empty()) return false;
  // No primary context anywhere: no CUDA allocation can exist, and querying would
  // create a context (hundreds of MB of device memory) for a host-only copy. The queries
  // run on a device that already has one, so they never create a context either.
  const int queried_on = device_with_context();
  if (queried_on < 0) return false;
  AddressKind src, dst;
  {
    c10::cuda::CUDAGuard query_guard(static_cast<c10::DeviceIndex>(queried_on));
    src = classify_address(descs.front().src);
    dst = classify_address(descs.front().dst);
  }
  if (src.known && dst.known && src.where == kHost && dst.where == kHost) return false;
  const int owner = dst.where != kHost ? dst.where : src.where != kHost ? src.where : queried_on;
  const auto index = static_cast<c10::DeviceIndex>(owner);
  c10::cuda::CUDAGuard guard(index);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(index).stream();
  copy_on_stream(descs, stream, src.where, dst.where);
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

TORCH_LIBRARY_IMPL(kvops, CUDA, m) {
  m.impl("swap_blocks_batch", &swap_blocks_batch_cuda);
  m.impl("swap_blocks_batch.ptrs", &swap_blocks_batch_ptrs_cuda);
  m.impl("record_layer_event", &record_layer_event_cuda);
  m.impl("push_layer", &push_layer_cuda);
}

}  // namespace kvops

#endif  // __CUDA_ARCH__
