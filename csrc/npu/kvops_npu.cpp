// Ascend NPU backend (torch_npu, DeviceType::PrivateUse1): batched block copies on the
// current NPU stream, per-layer ACL events, and the LayerEvents device-events factory.
//
// STATUS: written against the public CANN runtime (ACL) headers and torch_npu's C++
// headers; NOT compiled against a real CANN toolkit and NOT run on Ascend hardware.
// See docs/npu.md for the API versions it follows and what to check first.
//
// Ground rules followed below:
// * Copies and event records are issued on the stream returned by `NPUStream::stream()`,
//   which first drains torch_npu's task queue (TASK_QUEUE_ENABLE): ops called before ours
//   may still sit in that host queue, and an aclrtRecordEvent / aclrtMemcpyAsync issued
//   straight to the stream would otherwise overtake them.
// * Every ACL return code is checked and reported with the call's name and the code.
// * ACL entry points that older CANN releases lack (aclmdlRICaptureGetInfo,
//   aclrtCreateEventExWithFlag, aclrtPointerGetAttributes, ...) are resolved at run time
//   from libascendcl.so so the extension still loads there. aclrtMemcpyBatchAsync is the
//   one exception: setup.py defines KVOPS_NPU_BATCH_MEMCPY=1 only when the CANN header
//   declares it (or when forced), so it is called directly.
//
// CANN headers come first: torch_npu's headers include their own bundled copy of the ACL
// headers under the same include guards, and that copy may be older than the toolkit's.
#include <acl/acl.h>
#include <acl/acl_rt.h>

#include <torch/library.h>

#include "torch_npu/csrc/core/npu/NPUGuard.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/block_plan.h"
#include "../core/layer_events.h"

#ifndef KVOPS_NPU_BATCH_MEMCPY
#define KVOPS_NPU_BATCH_MEMCPY 0
#endif

namespace kvops {
namespace {

// ---------------------------------------------------------------------------------------
// ACL helpers
// ---------------------------------------------------------------------------------------

// ACL_ERROR_RT_FEATURE_NOT_SUPPORT (acl/error_codes/rt_error_codes.h).
constexpr aclError kAclFeatureNotSupported = 207000;
// ACL_EVENT_SYNC (acl_rt.h): the flag torch_npu's NPUEvent uses with
// aclrtCreateEventExWithFlag.
constexpr uint32_t kAclEventSync = 0x00000001U;
// aclmdlRICaptureStatus / aclmdlRICaptureMode values (acl_rt.h of releases with ACL graph
// capture); spelled out because older headers do not declare the enums.
constexpr int kCaptureStatusNone = 0;
constexpr int kCaptureModeRelaxed = 2;
// aclrtMemLocationType values (acl_rt.h): DEVICE = 1, MANAGED = 3.
constexpr int kMemLocationDevice = 1;
constexpr int kMemLocationManaged = 3;

// Looks up an optional ACL entry point. libascendcl.so is already loaded (this extension
// and torch_npu link it); a handle from dlopen is used rather than RTLD_DEFAULT because
// Python loads extension modules with RTLD_LOCAL.
void* acl_symbol(const char* name) {
  static void* lib = [] {
    void* h = dlopen("libascendcl.so", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libascendcl.so", RTLD_NOW);
    return h;
  }();
  return lib == nullptr ? nullptr : dlsym(lib, name);
}

// aclGetRecentErrMsg() (acl_base.h) as a suffix for error messages; empty if unavailable.
std::string recent_acl_error() {
  using Fn = const char* (*)();
  static Fn fn = reinterpret_cast<Fn>(acl_symbol("aclGetRecentErrMsg"));
  if (fn == nullptr) return "";
  const char* msg = fn();
  return (msg == nullptr || *msg == '\0') ? "" : std::string("; ACL reports: ") + msg;
}

// Message arguments are only evaluated on failure (TORCH_CHECK is lazy), so this costs
// nothing on the per-copy hot path. The trailing arguments must not be empty.
#define KVOPS_ACL_CHECK(expr, call, ...)                                                      \
  do {                                                                                        \
    const aclError kvops_acl_err = (expr);                                                    \
    TORCH_CHECK(kvops_acl_err == ACL_SUCCESS, "kvops NPU: ", call, " failed with aclError ",  \
                kvops_acl_err, __VA_ARGS__, ::kvops::recent_acl_error());                     \
  } while (0)

// The current torch_npu stream of `index` as a raw aclrtStream, after draining torch_npu's
// task queue so that work issued here lands after every op already called.
aclrtStream current_stream_flushed(c10::DeviceIndex index) {
  c10_npu::NPUStream stream = c10_npu::getCurrentNPUStream(index);
  aclrtStream raw = stream.stream();  // MakeSureQueueEmpty(); nullptr if that failed
  TORCH_CHECK(raw != nullptr, "kvops NPU: torch_npu could not drain its task queue for the "
              "current stream of npu:", static_cast<int>(index), " (NPUStream::stream() returned null)");
  return raw;
}

// True while `stream` is being captured into an ACL graph (aclmdlRICaptureBegin, which
// torch.npu.NPUGraph uses). CANN releases without aclmdlRICaptureGetInfo cannot capture.
bool stream_is_capturing(aclrtStream stream) {
  using Fn = aclError (*)(aclrtStream, int* /*aclmdlRICaptureStatus*/, void** /*aclmdlRI*/);
  static Fn fn = reinterpret_cast<Fn>(acl_symbol("aclmdlRICaptureGetInfo"));
  if (fn == nullptr) return false;
  int status = kCaptureStatusNone;
  void* model = nullptr;
  const aclError err = fn(stream, &status, &model);
  // SoCs without capture support (torch_npu skips the query there) may answer "feature
  // not supported": such a stream cannot be capturing.
  if (err == kAclFeatureNotSupported) return false;
  KVOPS_ACL_CHECK(err, "aclmdlRICaptureGetInfo", " (stream ", stream, ")");
  return status != kCaptureStatusNone;  // ACTIVE or INVALIDATED
}

// Switches this thread's capture mode to RELAXED for the scope (aclmdlRICaptureThread-
// ExchangeMode), so that a sender thread polling events cannot invalidate a capture that
// another thread runs in GLOBAL mode (the CUDA rule; assumed to hold for ACL graphs too).
class RelaxedCaptureModeScope {
 public:
  RelaxedCaptureModeScope() {
    if (fn() == nullptr) return;
    mode_ = kCaptureModeRelaxed;
    active_ = fn()(&mode_) == ACL_SUCCESS;  // on failure nothing changed: nothing to undo
  }
  ~RelaxedCaptureModeScope() {
    if (active_) (void)fn()(&mode_);  // restores the previous mode; cannot throw here
  }
  RelaxedCaptureModeScope(const RelaxedCaptureModeScope&) = delete;
  RelaxedCaptureModeScope& operator=(const RelaxedCaptureModeScope&) = delete;

 private:
  using Fn = aclError (*)(int* /*aclmdlRICaptureMode*/);
  static Fn fn() {
    static Fn f = reinterpret_cast<Fn>(acl_symbol("aclmdlRICaptureThreadExchangeMode"));
    return f;
  }
  int mode_ = 0;
  bool active_ = false;
};

// ---------------------------------------------------------------------------------------
// Copies
// ---------------------------------------------------------------------------------------

enum class Direction { kHostToDevice, kDeviceToHost, kDeviceToDevice };

aclrtMemcpyKind memcpy_kind(Direction dir) {
  switch (dir) {
    case Direction::kHostToDevice: return ACL_MEMCPY_HOST_TO_DEVICE;
    case Direction::kDeviceToHost: return ACL_MEMCPY_DEVICE_TO_HOST;
    case Direction::kDeviceToDevice: return ACL_MEMCPY_DEVICE_TO_DEVICE;
  }
  TORCH_CHECK(false, "kvops NPU: unknown copy direction");
}

const char* direction_name(Direction dir) {
  switch (dir) {
    case Direction::kHostToDevice: return "host-to-device";
    case Direction::kDeviceToHost: return "device-to-host";
    case Direction::kDeviceToDevice: return "device-to-device";
  }
  return "?";
}

std::string alignment_hint(Direction dir, const CopyDesc& d) {
  // acl_rt.h, aclrtMemcpyAsync: on-chip device-to-device copies need 64-byte aligned
  // source and destination addresses.
  if (dir == Direction::kDeviceToDevice && ((d.src | d.dst) % 64) != 0) {
    return "; note: device-to-device copies need 64-byte aligned addresses";
  }
  return "";
}

// One aclrtMemcpyAsync per descriptor (~microseconds of CPU each). With non-pinned host
// memory each call returns only after its copy finished.
void copy_one_by_one(const std::vector<CopyDesc>& descs, size_t begin, Direction dir,
                     aclrtStream stream) {
  const aclrtMemcpyKind kind = memcpy_kind(dir);
  for (size_t k = begin; k < descs.size(); ++k) {
    const CopyDesc& d = descs[k];
    KVOPS_ACL_CHECK(aclrtMemcpyAsync(reinterpret_cast<void*>(d.dst), d.bytes,
                                     reinterpret_cast<const void*>(d.src), d.bytes, kind, stream),
                    "aclrtMemcpyAsync", " (", direction_name(dir), " copy ", k, " of ", descs.size(),
                    ": src=", reinterpret_cast<const void*>(d.src), " dst=",
                    reinterpret_cast<const void*>(d.dst), " bytes=", d.bytes, ")",
                    alignment_hint(dir, d));
  }
}

#if KVOPS_NPU_BATCH_MEMCPY
// Cleared for the process when the runtime says the batch API is unsupported (the CANN
// docs list it for Atlas A2/A3 and Ascend 950 only).
std::atomic<bool> g_batch_usable{true};

// Submits descs[begin, begin + n) with one aclrtMemcpyBatchAsync call (CANN >= 8.5;
// signature from acl_rt.h: dsts, destMaxs, srcs, sizes, numBatches, attrs, attrsIndexes,
// numAttrs, failIndex, stream). Returns false when the call fails; the caller then copies
// the same range one by one (repeating a copy that may have gone through is harmless:
// planned copies never overlap).
bool copy_batch_slice(const std::vector<CopyDesc>& descs, size_t begin, size_t n,
                      Direction dir, c10::DeviceIndex device, aclrtStream stream,
                      std::vector<void*>& dsts, std::vector<void*>& srcs,
                      std::vector<size_t>& sizes) {
  dsts.resize(n);
  srcs.resize(n);
  sizes.resize(n);
  for (size_t k = 0; k < n; ++k) {
    const CopyDesc& d = descs[begin + k];
    dsts[k] = reinterpret_cast<void*>(d.dst);
    srcs[k] = reinterpret_cast<void*>(d.src);
    sizes[k] = d.bytes;
  }
  // One attribute for the whole slice: the API accepts a single direction per batch
  // (host-to-device or device-to-host). Host location id 0, as vllm-ascend passes it.
  aclrtMemLocation host{};
  host.type = ACL_MEM_LOCATION_TYPE_HOST;
  host.id = 0;
  aclrtMemLocation dev{};
  dev.type = ACL_MEM_LOCATION_TYPE_DEVICE;
  dev.id = static_cast<uint32_t>(device);
  aclrtMemcpyBatchAttr attr;
  std::memset(&attr, 0, sizeof(attr));  // rsv must be zero
  attr.srcLoc = dir == Direction::kHostToDevice ? host : dev;
  attr.dstLoc = dir == Direction::kHostToDevice ? dev : host;
  size_t attr_index = 0;
  size_t fail_index = SIZE_MAX;
  // destMaxs: each destination range is exactly `bytes` long, so sizes serves for both.
  const aclError err = aclrtMemcpyBatchAsync(dsts.data(), sizes.data(), srcs.data(),
                                             sizes.data(), n, &attr, &attr_index, 1,
                                             &fail_index, stream);
  if (err == ACL_SUCCESS) return true;
  if (err == kAclFeatureNotSupported) {
    g_batch_usable.store(false);
    TORCH_WARN_ONCE("kvops NPU: aclrtMemcpyBatchAsync is not supported here (aclError ", err,
                    recent_acl_error(), "); using one aclrtMemcpyAsync per copy from now on");
  } else {
    TORCH_WARN_ONCE("kvops NPU: aclrtMemcpyBatchAsync failed with aclError ", err,
                    " (failIndex ", fail_index == SIZE_MAX ? std::string("none")
                                                            : std::to_string(begin + fail_index),
                    ")", recent_acl_error(), "; falling back to one aclrtMemcpyAsync per copy");
  }
  return false;
}
#endif

// Queues every descriptor on `stream`. Batched when the build has the batch API, the
// direction is host<->device (vllm-ascend also keeps device-to-device on the per-copy
// path) and the stream is not being captured (the batch call's behaviour under ACL graph
// capture is undocumented; the CUDA equivalent silently drops the copy).
void submit_copies(const std::vector<CopyDesc>& descs, Direction dir, c10::DeviceIndex device,
                   aclrtStream stream, bool capturing) {
  size_t done = 0;
#if KVOPS_NPU_BATCH_MEMCPY
  if (dir != Direction::kDeviceToDevice && !capturing && g_batch_usable.load()) {
    std::vector<void*> dsts, srcs;
    std::vector<size_t> sizes;
    while (done < descs.size()) {
      const size_t n = std::min(kMaxDescriptorsPerCall, descs.size() - done);
      if (!copy_batch_slice(descs, done, n, dir, device, stream, dsts, srcs, sizes)) break;
      done += n;
    }
  }
#else
  (void)device;
  (void)capturing;
#endif
  copy_one_by_one(descs, done, dir, stream);
}

// swap_blocks_batch with at least one NPU side (CPU<->CPU dispatches to the CPU kernel).
void swap_blocks_batch_npu(at::TensorList src, at::TensorList dst, const at::Tensor& mapping) {
  CopyPlan plan = plan_block_copies(src.vec(), dst.vec(), mapping);
  if (plan.descs.empty()) return;
  const bool src_npu = plan.src_device.type() == c10::DeviceType::PrivateUse1;
  const bool dst_npu = plan.dst_device.type() == c10::DeviceType::PrivateUse1;
  TORCH_CHECK(src_npu || dst_npu, "swap_blocks_batch (NPU): neither side is on an NPU (",
              plan.src_device, " -> ", plan.dst_device, ")");
  Direction dir;
  c10::Device device = src_npu ? plan.src_device : plan.dst_device;
  if (src_npu && dst_npu) {
    // Cross-device copies would need aclrtDeviceEnablePeerAccess; not supported here.
    TORCH_CHECK(plan.src_device == plan.dst_device,
                "swap_blocks_batch (NPU): src is on ", plan.src_device, " but dst is on ",
                plan.dst_device, "; copies between two NPUs are not supported");
    dir = Direction::kDeviceToDevice;
  } else {
    dir = src_npu ? Direction::kDeviceToHost : Direction::kHostToDevice;
  }
  c10_npu::NPUGuard guard(device);
  aclrtStream stream = current_stream_flushed(device.index());
  submit_copies(plan.descs, dir, device.index(), stream, stream_is_capturing(stream));
}

// Raw-address copies (swap_blocks_batch.ptrs, CPU-dispatched): claims the batch when its
// first copy touches NPU memory. aclrtPointerGetAttributes reports ACL-allocated device
// memory (all torch_npu device memory comes from aclrtMalloc) as DEVICE; the CANN 8.x docs
// support the query only for memory allocated through ACL, so an error or any other answer
// is taken to mean "host". A .ptrs batch must use one direction: the first and last copies
// are classified and must agree (classifying every address would cost two driver calls
// per copy). Copies go on the current stream of the NPU that owns the device addresses.
struct PtrLocation {
  bool device = false;
  bool managed = false;
  uint32_t id = 0;
};

// Layout of aclrtPtrAttributes (acl_rt.h): {aclrtMemLocation{uint32_t id; enum type};
// uint32_t pageSize; uint32_t rsv[4]}. Mirrored so that older headers without the struct
// still compile; the symbol itself is looked up at run time.
struct AclPtrAttributes {
  uint32_t id;
  int32_t type;
  uint32_t page_size;
  uint32_t rsv[4];
};
using PointerGetAttributesFn = aclError (*)(const void*, AclPtrAttributes*);

PointerGetAttributesFn pointer_get_attributes() {
  static PointerGetAttributesFn fn =
      reinterpret_cast<PointerGetAttributesFn>(acl_symbol("aclrtPointerGetAttributes"));
  return fn;
}

PtrLocation locate(uintptr_t address) {
  AclPtrAttributes attrs;
  std::memset(&attrs, 0, sizeof(attrs));
  PtrLocation loc;
  if (pointer_get_attributes()(reinterpret_cast<const void*>(address), &attrs) != ACL_SUCCESS) {
    return loc;  // not ACL memory: host
  }
  loc.device = attrs.type == kMemLocationDevice;
  loc.managed = attrs.type == kMemLocationManaged;
  loc.id = attrs.id;
  return loc;
}

bool copy_npu_ptrs(const std::vector<CopyDesc>& descs) {
  if (descs.empty() || pointer_get_attributes() == nullptr) return false;
  const PtrLocation s = locate(descs.front().src), d = locate(descs.front().dst);
  if (!s.device && !d.device) return false;  // host memory: the CPU kernel copies it
  TORCH_CHECK(!s.managed && !d.managed, "swap_blocks_batch.ptrs (NPU): managed (UVM) memory "
              "is not supported (copy 0: src=", reinterpret_cast<const void*>(descs.front().src),
              " dst=", reinterpret_cast<const void*>(descs.front().dst), ")");
  if (s.device && d.device) {
    TORCH_CHECK(s.id == d.id, "swap_blocks_batch.ptrs (NPU): copy 0 goes from npu:", s.id,
                " to npu:", d.id, "; copies between two NPUs are not supported");
  }
  if (descs.size() > 1) {
    const PtrLocation ls = locate(descs.back().src), ld = locate(descs.back().dst);
    const bool same = ls.device == s.device && ld.device == d.device &&
                      (!s.device || ls.id == s.id) && (!d.device || ld.id == d.id);
    TORCH_CHECK(same, "swap_blocks_batch.ptrs (NPU): the first and last copies differ in "
                "direction or device; one call must copy in one direction on one NPU (src_ptrs[0]=",
                reinterpret_cast<const void*>(descs.front().src), ", src_ptrs[-1]=",
                reinterpret_cast<const void*>(descs.back().src), ")");
  }
  const Direction dir = s.device ? (d.device ? Direction::kDeviceToDevice
                                             : Direction::kDeviceToHost)
                                 : Direction::kHostToDevice;
  const auto index = static_cast<c10::DeviceIndex>(s.device ? s.id : d.id);
  c10_npu::NPUGuard guard(c10::Device(c10::DeviceType::PrivateUse1, index));
  aclrtStream stream = current_stream_flushed(index);
  submit_copies(descs, dir, index, stream, stream_is_capturing(stream));
  return true;
}

// ---------------------------------------------------------------------------------------
// Layer events
// ---------------------------------------------------------------------------------------

// One ACL event per layer. Events come from aclrtCreateEventExWithFlag(ACL_EVENT_SYNC)
// when the runtime has it (the documented re-recordable kind, and what torch_npu's
// NPUEvent uses), else from aclrtCreateEvent.
class NpuLayerEvents final : public DeviceEvents {
 public:
  NpuLayerEvents(int64_t num_layers, c10::Device device)
      : device_(device),
        events_(static_cast<size_t>(num_layers), nullptr),
        recorded_(new std::atomic<bool>[static_cast<size_t>(num_layers)]()) {
    using CreateExFn = aclError (*)(aclrtEvent*, uint32_t);
    static CreateExFn create_ex =
        reinterpret_cast<CreateExFn>(acl_symbol("aclrtCreateEventExWithFlag"));
    c10_npu::NPUGuard guard(device_);
    try {
      for (size_t i = 0; i < events_.size(); ++i) {
        if (create_ex != nullptr) {
          KVOPS_ACL_CHECK(create_ex(&events_[i], kAclEventSync), "aclrtCreateEventExWithFlag",
                          " (layer ", i, " of ", events_.size(), " on ", device_, ")");
        } else {
          KVOPS_ACL_CHECK(aclrtCreateEvent(&events_[i]), "aclrtCreateEvent", " (layer ", i,
                          " of ", events_.size(), " on ", device_, ")");
        }
      }
    } catch (...) {
      destroy_all();
      throw;
    }
  }

  ~NpuLayerEvents() override {
    try {
      c10_npu::NPUGuard guard(device_);
      destroy_all();
    } catch (...) {
      // A destructor cannot report: the runtime may already be finalized at exit.
    }
  }

  NpuLayerEvents(const NpuLayerEvents&) = delete;
  NpuLayerEvents& operator=(const NpuLayerEvents&) = delete;

  c10::Device device() const { return device_; }

  // Caller holds an NPUGuard for device_ and passes a flushed stream of that device.
  void record(int64_t layer, aclrtStream stream) {
    KVOPS_ACL_CHECK(aclrtRecordEvent(events_[layer], stream), "aclrtRecordEvent", " (layer ",
                    layer, " on ", device_, ")");
    recorded_[layer].store(true, std::memory_order_release);
  }

  // Called from the sender thread (LayerEventPool::wait), never synchronizes.
  bool query(int64_t layer) override {
    // Never recorded: nothing to wait for (the CUDA and CPU backends answer the same).
    if (!recorded_[layer].load(std::memory_order_acquire)) return true;
    c10_npu::NPUGuard guard(device_);  // the polling thread may not have set a device
    RelaxedCaptureModeScope relaxed;
    aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    KVOPS_ACL_CHECK(aclrtQueryEventStatus(events_[layer], &status), "aclrtQueryEventStatus",
                    " (layer ", layer, " on ", device_, ")");
    return status == ACL_EVENT_RECORDED_STATUS_COMPLETE;
  }

 private:
  // aclrtDestroyEvent may be called before the event completed: the runtime frees it
  // once it has. Errors are ignored: this only runs on close or on a failed constructor.
  void destroy_all() noexcept {
    for (aclrtEvent& ev : events_) {
      if (ev != nullptr) (void)aclrtDestroyEvent(ev);
      ev = nullptr;
    }
  }

  const c10::Device device_;
  std::vector<aclrtEvent> events_;
  std::unique_ptr<std::atomic<bool>[]> recorded_;
};

NpuLayerEvents& npu_events(const std::shared_ptr<LayerEventPool>& pool) {
  auto* events = dynamic_cast<NpuLayerEvents*>(pool->events());
  TORCH_CHECK(events != nullptr, "LayerEvents: handle ", pool->handle(), " on ", pool->device(),
              " has no NPU events");
  return *events;
}

const char* kCaptureUnsupported =
    " is not supported while the NPU stream is being captured into a graph (torch.npu.NPUGraph"
    " / ACL graph capture): torch_kvops has no NPU graph support yet. Run the layer-wise "
    "transfer in eager mode or in piecewise graphs that leave these ops outside the capture.";

void record_layer_event_npu(const at::Tensor& kv_cache, int64_t handle, int64_t layer) {
  auto pool = pool_for_op(kv_cache, handle, layer);
  NpuLayerEvents& events = npu_events(pool);
  c10_npu::NPUGuard guard(kv_cache.device());
  aclrtStream stream = current_stream_flushed(kv_cache.device().index());
  // A plain record inside a capture would not give the host an event it can poll after
  // each replay (CUDA needs an "external" record node for that; the ACL counterpart,
  // aclrtRecordEventWithFlag(ACL_EVENT_RECORD_EXTERNAL), is new and unverified here).
  TORCH_CHECK(!stream_is_capturing(stream), "record_layer_event", kCaptureUnsupported);
  events.record(layer, stream);
}

// The CUDA backend appends the layer from a host node (cudaLaunchHostFunc), in stream
// order and again on every graph replay. This backend appends when the op is called:
// * aclrtLaunchCallback needs a host thread registered per stream with
//   aclrtSubscribeReport (plus aclrtProcessReport polling and unsubscription) - plumbing
//   this library does not have yet;
// * aclrtLaunchHostFunc creates that thread itself, but the CANN docs forbid mixing it
//   with aclrtLaunchCallback on one stream, which torch_npu's own
//   torch.npu._launch_host_func / _subscribe_report do on user streams (vllm-ascend
//   subscribes the compute stream), and the CANN 8.3.RC1 docs did not allow it under
//   capture (later docs dropped that line).
// Appending early is safe for the documented protocol: the layer's event was recorded
// before this call, and the sender calls LayerEvents.wait(layer) - which polls that
// event - before touching the layer, so next_ready() just hands the layer out sooner.
// A push at call time inside a graph capture would happen once and never on replay, so
// it is refused.
void push_layer_npu(const at::Tensor& kv_cache, int64_t handle, int64_t layer) {
  auto pool = pool_for_op(kv_cache, handle, layer);
  c10_npu::NPUGuard guard(kv_cache.device());
  // No flush needed: nothing is submitted to the stream here.
  aclrtStream stream = c10_npu::getCurrentNPUStream(kv_cache.device().index()).stream(false);
  TORCH_CHECK(!stream_is_capturing(stream), "push_layer", kCaptureUnsupported);
  pool->push(layer);
}

std::unique_ptr<DeviceEvents> make_npu_events(int64_t num_layers, c10::Device device) {
  TORCH_CHECK(device.has_index(), "LayerEvents: an NPU pool needs an explicit device index "
              "(e.g. 'npu:0', or f'npu:{torch.npu.current_device()}'), got ", device);
  return std::make_unique<NpuLayerEvents>(num_layers, device);
}

// Registered at load time, like the kernels below.
[[maybe_unused]] const bool kNpuRegistered = [] {
  register_device_events_factory(c10::DeviceType::PrivateUse1, &make_npu_events);
  register_ptr_copier(&copy_npu_ptrs);
  return true;
}();

}  // namespace

TORCH_LIBRARY_IMPL(kvops, PrivateUse1, m) {
  m.impl("swap_blocks_batch", &swap_blocks_batch_npu);
  m.impl("record_layer_event", &record_layer_event_npu);
  m.impl("push_layer", &push_layer_npu);
}

}  // namespace kvops
