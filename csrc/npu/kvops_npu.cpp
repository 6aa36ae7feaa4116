// Ascend NPU backend (torch_npu, DeviceType::PrivateUse1): batched block copies on the
// current NPU stream, per-layer ACL events, and the LayerEvents device-events factory.
//
// STATUS: compiled and linked in CI against torch_npu 2.13.0's headers, its bundled ACL
// headers and its libtorch_npu.so (scripts/check_npu_build.sh); NOT run: no CANN runtime
// and no Ascend hardware there. See docs/npu.md for what to check first on hardware.
//
// Ground rules followed below:
// * Copies and event records are issued on the stream returned by `NPUStream::stream()`,
//   which first drains torch_npu's task queue (TASK_QUEUE_ENABLE): ops called before ours
//   may still sit in that host queue, and an aclrtRecordEvent / aclrtMemcpyAsync issued
//   straight to the stream would otherwise overtake them.
// * Every ACL return code is checked and reported with the call's name and the code.
// * Only ACL entry points that libtorch_npu.so imports directly are linked; the others
//   are resolved at run time and have a fallback (acl_binding.h).
// * ACL types and constants come from the ACL headers bundled with torch_npu (setup.py
//   puts torch_npu's include/ first, as torch_npu's own NpuExtension does): the headers
//   torch_npu itself was built with. Nothing of them is mirrored here.
#include "acl_binding.h"

#include <torch/library.h>

#include "torch_npu/csrc/core/npu/NPUGuard.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../core/block_plan.h"
#include "../core/layer_events.h"

namespace kvops {
namespace {

// ---------------------------------------------------------------------------------------
// ACL helpers
// ---------------------------------------------------------------------------------------

// aclGetRecentErrMsg() as a suffix for error messages; empty if unavailable.
std::string recent_acl_error() {
  static const auto fn = KVOPS_ACL_OPTIONAL(aclGetRecentErrMsg);
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
// torch.npu.NPUGraph uses). A CANN without aclmdlRICaptureGetInfo cannot capture.
bool stream_is_capturing(aclrtStream stream) {
  static const auto get_info = KVOPS_ACL_OPTIONAL(aclmdlRICaptureGetInfo);
  if (get_info == nullptr) return false;
  aclmdlRICaptureStatus status = ACL_MODEL_RI_CAPTURE_STATUS_NONE;
  aclmdlRI model = nullptr;
  const aclError err = get_info(stream, &status, &model);
  // SoCs without capture support (torch_npu skips the query there) may answer "feature
  // not supported": such a stream cannot be capturing.
  if (err == ACL_ERROR_RT_FEATURE_NOT_SUPPORT) return false;
  KVOPS_ACL_CHECK(err, "aclmdlRICaptureGetInfo", " (stream ", stream, ")");
  return status != ACL_MODEL_RI_CAPTURE_STATUS_NONE;  // ACTIVE or INVALIDATED
}

// Switches this thread's capture mode to RELAXED for the scope (aclmdlRICaptureThread-
// ExchangeMode), so that a sender thread polling events cannot invalidate a capture that
// another thread runs in GLOBAL mode (the CUDA rule; assumed to hold for ACL graphs too).
// Without the entry point there is no capture to protect: nothing to do.
class RelaxedCaptureModeScope {
 public:
  RelaxedCaptureModeScope() {
    if (exchange() == nullptr) return;
    mode_ = ACL_MODEL_RI_CAPTURE_MODE_RELAXED;
    active_ = exchange()(&mode_) == ACL_SUCCESS;  // on failure nothing changed: nothing to undo
  }
  ~RelaxedCaptureModeScope() {
    if (active_) (void)exchange()(&mode_);  // restores the previous mode; cannot throw here
  }
  RelaxedCaptureModeScope(const RelaxedCaptureModeScope&) = delete;
  RelaxedCaptureModeScope& operator=(const RelaxedCaptureModeScope&) = delete;

 private:
  using ExchangeFn = decltype(&::aclmdlRICaptureThreadExchangeMode);
  static ExchangeFn exchange() {
    static const ExchangeFn fn = KVOPS_ACL_OPTIONAL(aclmdlRICaptureThreadExchangeMode);
    return fn;
  }
  aclmdlRICaptureMode mode_ = ACL_MODEL_RI_CAPTURE_MODE_GLOBAL;
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

using MemcpyBatchAsyncFn = decltype(&::aclrtMemcpyBatchAsync);

// aclrtMemcpyBatchAsync (CANN >= 8.5, resolved at run time: libtorch_npu.so resolves it
// too), or nullptr when this CANN lacks it or KVOPS_NPU_BATCH_MEMCPY=0 turns it off (to
// compare with the per-copy path on hardware). Without it every copy is one
// aclrtMemcpyAsync.
MemcpyBatchAsyncFn memcpy_batch_async() {
  static const MemcpyBatchAsyncFn fn = []() -> MemcpyBatchAsyncFn {
    const char* env = std::getenv("KVOPS_NPU_BATCH_MEMCPY");
    if (env != nullptr && std::strcmp(env, "0") == 0) return nullptr;
    return KVOPS_ACL_OPTIONAL(aclrtMemcpyBatchAsync);
  }();
  return fn;
}

// Cleared for the process when the runtime says the batch API is unsupported (the CANN
// docs list it for Atlas A2/A3 and Ascend 950 only).
std::atomic<bool> g_batch_usable{true};

// Submits descs[begin, begin + n) with one aclrtMemcpyBatchAsync call (CANN >= 8.5;
// signature from acl_rt.h: dsts, destMaxs, srcs, sizes, numBatches, attrs, attrsIndexes,
// numAttrs, failIndex, stream). Returns false when the call fails; the caller then copies
// the same range one by one (repeating a copy that may have gone through is harmless:
// planned copies never overlap).
bool copy_batch_slice(MemcpyBatchAsyncFn batch, const std::vector<CopyDesc>& descs,
                      size_t begin, size_t n, Direction dir, c10::DeviceIndex device,
                      aclrtStream stream, std::vector<void*>& dsts, std::vector<void*>& srcs,
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
  const aclError err = batch(dsts.data(), sizes.data(), srcs.data(), sizes.data(), n, &attr,
                             &attr_index, 1, &fail_index, stream);
  if (err == ACL_SUCCESS) return true;
  if (err == ACL_ERROR_RT_FEATURE_NOT_SUPPORT) {
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

// Queues every descriptor on `stream`. Batched when the runtime has the batch API, the
// direction is host<->device (vllm-ascend also keeps device-to-device on the per-copy
// path) and the stream is not being captured (the batch call's behaviour under ACL graph
// capture is undocumented; the CUDA equivalent silently drops the copy).
void submit_copies(const std::vector<CopyDesc>& descs, Direction dir, c10::DeviceIndex device,
                   aclrtStream stream, bool capturing) {
  size_t done = 0;
  const MemcpyBatchAsyncFn batch = memcpy_batch_async();
  if (batch != nullptr && dir != Direction::kDeviceToDevice && !capturing &&
      g_batch_usable.load()) {
    std::vector<void*> dsts, srcs;
    std::vector<size_t> sizes;
    while (done < descs.size()) {
      const size_t n = std::min(kMaxDescriptorsPerCall, descs.size() - done);
      if (!copy_batch_slice(batch, descs, done, n, dir, device, stream, dsts, srcs, sizes)) break;
      done += n;
    }
  }
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
// Without aclrtPointerGetAttributes (resolved at run time) nothing can be classified and
// every .ptrs batch is left to the CPU kernel: host memory only on such a CANN.
struct PtrLocation {
  bool device = false;
  uint32_t id = 0;
};

using PointerGetAttributesFn = decltype(&::aclrtPointerGetAttributes);

PointerGetAttributesFn pointer_get_attributes() {
  static const PointerGetAttributesFn fn = KVOPS_ACL_OPTIONAL(aclrtPointerGetAttributes);
  return fn;
}

PtrLocation locate(uintptr_t address) {
  aclrtPtrAttributes attrs;
  std::memset(&attrs, 0, sizeof(attrs));
  PtrLocation loc;
  if (pointer_get_attributes()(reinterpret_cast<const void*>(address), &attrs) != ACL_SUCCESS) {
    return loc;  // not ACL memory: host
  }
  // HOST, UNREGISTERED (plain malloc) and HOST_NUMA are all host memory.
  loc.device = attrs.location.type == ACL_MEM_LOCATION_TYPE_DEVICE;
  loc.id = attrs.location.id;
  return loc;
}

bool copy_npu_ptrs(const std::vector<CopyDesc>& descs) {
  if (descs.empty() || pointer_get_attributes() == nullptr) return false;
  const PtrLocation s = locate(descs.front().src), d = locate(descs.front().dst);
  if (!s.device && !d.device) return false;  // host memory: the CPU kernel copies it
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

// Layer events are of one of two kinds, picked once per process from what the runtime has.
// * torch_npu's kind: aclrtCreateEventExWithFlag(ACL_EVENT_SYNC) (re-recordable; linked
//   directly, libtorch_npu.so imports it), polled with aclrtQueryEventStatus - the only
//   status query such events support (torch_npu's AclInterface.cpp: not aclrtQueryEvent).
// * Without aclrtQueryEventStatus (resolved at run time, as torch_npu resolves it):
//   classic events from aclrtCreateEvent polled with the deprecated aclrtQueryEvent, what
//   torch_npu's NPUEvent did before aclrtQueryEventStatus existed. Both are looked up too:
//   libtorch_npu.so 2.13 imports neither.
// Neither kind is synchronized on: aclrtSynchronizeEvent would block the polling thread.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"  // naming aclrtQueryEvent's type
using QueryEventFn = decltype(&::aclrtQueryEvent);
#pragma GCC diagnostic pop

struct EventApi {
  decltype(&::aclrtQueryEventStatus) query_status;  // set: torch_npu's kind
  decltype(&::aclrtCreateEvent) create_classic;
  QueryEventFn query_classic;
};

const EventApi& event_api() {
  static const EventApi api{KVOPS_ACL_OPTIONAL(aclrtQueryEventStatus),
                            KVOPS_ACL_OPTIONAL(aclrtCreateEvent),
                            acl_optional<QueryEventFn>("aclrtQueryEvent")};
  return api;
}

// One ACL event per layer, of the kind event_api() picks.
class NpuLayerEvents final : public DeviceEvents {
 public:
  NpuLayerEvents(int64_t num_layers, c10::Device device)
      : device_(device),
        events_(static_cast<size_t>(num_layers), nullptr),
        recorded_(new std::atomic<bool>[static_cast<size_t>(num_layers)]()) {
    const EventApi& api = event_api();
    TORCH_CHECK(api.query_status != nullptr ||
                    (api.create_classic != nullptr && api.query_classic != nullptr),
                "LayerEvents (NPU): this CANN's libascendcl.so has neither aclrtQueryEventStatus "
                "nor aclrtCreateEvent + aclrtQueryEvent, so layer events cannot be polled");
    c10_npu::NPUGuard guard(device_);
    try {
      for (size_t i = 0; i < events_.size(); ++i) {
        if (api.query_status != nullptr) {
          KVOPS_ACL_CHECK(aclrtCreateEventExWithFlag(&events_[i], ACL_EVENT_SYNC),
                          "aclrtCreateEventExWithFlag", " (layer ", i, " of ", events_.size(),
                          " on ", device_, ")");
        } else {
          KVOPS_ACL_CHECK(api.create_classic(&events_[i]), "aclrtCreateEvent", " (layer ", i,
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
    const EventApi& api = event_api();
    if (api.query_status != nullptr) {
      aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
      KVOPS_ACL_CHECK(api.query_status(events_[layer], &status), "aclrtQueryEventStatus",
                      " (layer ", layer, " on ", device_, ")");
      return status == ACL_EVENT_RECORDED_STATUS_COMPLETE;
    }
    aclrtEventStatus status = ACL_EVENT_STATUS_NOT_READY;
    KVOPS_ACL_CHECK(api.query_classic(events_[layer], &status), "aclrtQueryEvent", " (layer ",
                    layer, " on ", device_, ")");
    return status == ACL_EVENT_STATUS_COMPLETE;
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
