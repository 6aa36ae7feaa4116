// LayerEvents: one completion event per layer plus a host-side queue of layers that
// are ready to send. Pools live in a process-wide registry keyed by an integer handle,
// because the ops take the handle as a plain int (a constant inside compiled graphs).
//
// Device backends provide DeviceEvents (record/query); push() is pure host code so it
// can run inside a CUDA host callback on every graph replay.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

namespace kvops {

// Per-layer device events. query() must be callable from any host thread.
class DeviceEvents {
 public:
  virtual ~DeviceEvents() = default;
  // True once the latest record of `layer` has completed on the device.
  virtual bool query(int64_t layer) = 0;
};

class LayerEventPool {
 public:
  LayerEventPool(int64_t handle, int64_t num_layers, c10::Device device,
                 std::unique_ptr<DeviceEvents> events);

  int64_t handle() const { return handle_; }
  int64_t num_layers() const { return num_layers_; }
  c10::Device device() const { return device_; }
  DeviceEvents* events() const { return events_.get(); }

  // Thread-safe, no device API calls: safe from a stream host callback.
  void push(int64_t layer);
  // Oldest pushed layer, or nullopt on timeout / close. timeout < 0 waits forever.
  std::optional<int64_t> next_ready(double timeout_s);
  // Polls the device event (never a stream/device synchronize). False on timeout/close.
  bool wait(int64_t layer, double timeout_s);
  void close();
  bool closed();
  // Binding a layer to its KV cache's address lets the ops catch a compiled graph
  // that hands them a temporary copy instead of the cache (the real cache would be
  // written back only at the end of the graph, after the layer was already sent).
  void bind(int64_t layer, const void* data_ptr);
  void check_binding(int64_t layer, const void* data_ptr) const;
  // CLOCK_MONOTONIC seconds (Python's time.monotonic/perf_counter on Linux) of the
  // latest push of `layer`, 0 if never pushed. In eager mode that is when the model
  // issued the push; under CUDA-graph replay, when the stream reached the host node,
  // i.e. when the layer's KV write had finished on the device.
  double pushed_at(int64_t layer) const;

 private:
  const int64_t handle_;
  const int64_t num_layers_;
  const c10::Device device_;
  std::unique_ptr<DeviceEvents> events_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int64_t> ready_;
  bool closed_ = false;
  std::unique_ptr<std::atomic<uintptr_t>[]> bound_ptrs_;  // 0 = not bound
  std::unique_ptr<std::atomic<double>[]> pushed_at_;
};

using DeviceEventsFactory =
    std::function<std::unique_ptr<DeviceEvents>(int64_t num_layers, c10::Device device)>;
void register_device_events_factory(c10::DeviceType type, DeviceEventsFactory factory);

int64_t create_layer_event_pool(int64_t num_layers, c10::Device device);
// Looks up a live pool; raises for an unknown/closed handle, a layer out of range, or
// a tensor on another device than the pool's.
std::shared_ptr<LayerEventPool> get_layer_event_pool(int64_t handle, int64_t layer,
                                                     std::optional<c10::Device> device);
// The lookup every op does: pool of `handle`, `layer` in range, kv_cache on the pool's
// device and at the address bound to `layer` (if bound).
std::shared_ptr<LayerEventPool> pool_for_op(const at::Tensor& kv_cache, int64_t handle,
                                            int64_t layer);
// True for a handle that existed and was closed (blocking host calls then return
// "nothing" instead of raising, so a waiter racing close() ends quietly).
bool layer_event_pool_was_closed(int64_t handle);
// Non-throwing lookup for host callbacks: nullptr when the pool is gone.
std::shared_ptr<LayerEventPool> find_layer_event_pool(int64_t handle);
void close_layer_event_pool(int64_t handle);

// Host callbacks receive a single void*: pack (handle, layer) into it so no heap
// object has to outlive a captured graph.
void* pack_push_target(int64_t handle, int64_t layer);
void push_packed_target(void* packed);

}  // namespace kvops
