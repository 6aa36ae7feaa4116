#include "layer_events.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <unordered_map>
#include <vector>

namespace kvops {
namespace {

constexpr int kLayerBits = 20;  // up to ~1M layers per pool, ~2^43 handles

struct Registry {
  std::mutex mu;
  int64_t next_handle = 1;
  std::unordered_map<int64_t, std::shared_ptr<LayerEventPool>> pools;
  std::unordered_map<int, DeviceEventsFactory> factories;
  // Device events of closed pools are kept: a captured CUDA graph may still record
  // them on replay, and recording a destroyed event is undefined behaviour.
  std::vector<std::shared_ptr<LayerEventPool>> retired;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: callbacks may fire at exit
  return *r;
}

// The CPU needs no events: a layer is complete when its op runs in program order.
class CpuEvents final : public DeviceEvents {
 public:
  bool query(int64_t) override { return true; }
};

}  // namespace

LayerEventPool::LayerEventPool(int64_t handle, int64_t num_layers, c10::Device device,
                               std::unique_ptr<DeviceEvents> events)
    : handle_(handle),
      num_layers_(num_layers),
      device_(device),
      events_(std::move(events)),
      bound_ptrs_(new std::atomic<uintptr_t>[num_layers]),
      pushed_at_(new std::atomic<double>[num_layers]) {
  for (int64_t i = 0; i < num_layers; ++i) {
    bound_ptrs_[i].store(0);
    pushed_at_[i].store(0.0);
  }
}

double LayerEventPool::pushed_at(int64_t layer) const {
  TORCH_CHECK(layer >= 0 && layer < num_layers_, "LayerEvents.pushed_at: layer ", layer,
              " is out of range for ", num_layers_, " layers");
  return pushed_at_[layer].load();
}

void LayerEventPool::bind(int64_t layer, const void* data_ptr) {
  TORCH_CHECK(layer >= 0 && layer < num_layers_, "LayerEvents.bind: layer ", layer,
              " is out of range for ", num_layers_, " layers");
  bound_ptrs_[layer].store(reinterpret_cast<uintptr_t>(data_ptr));
}

void LayerEventPool::check_binding(int64_t layer, const void* data_ptr) const {
  const uintptr_t bound = bound_ptrs_[layer].load();
  TORCH_CHECK(bound == 0 || bound == reinterpret_cast<uintptr_t>(data_ptr),
              "LayerEvents: layer ", layer, " of handle ", handle_, " is bound to the KV cache at 0x",
              std::hex, bound, " but the op received a tensor at 0x",
              reinterpret_cast<uintptr_t>(data_ptr), std::dec,
              ". Under torch.compile this means the graph works on a temporary copy of the "
              "cache and writes it back only at the end, so the layer would be sent stale: "
              "write the KV cache with an in-place scatter (index_copy_/index_put_) on the "
              "cache tensor itself, or pass the cache tensor that was registered.");
}

void LayerEventPool::push(int64_t layer) {
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  pushed_at_[layer].store(std::chrono::duration<double>(now).count());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    ready_.push_back(layer);
  }
  cv_.notify_all();
}

std::optional<int64_t> LayerEventPool::next_ready(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] { return closed_ || !ready_.empty(); };
  if (timeout_s < 0) {
    cv_.wait(lock, ready);
  } else {
    cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready);
  }
  if (closed_ || ready_.empty()) return std::nullopt;
  int64_t layer = ready_.front();
  ready_.pop_front();
  return layer;
}

bool LayerEventPool::wait(int64_t layer, double timeout_s) {
  using clock = std::chrono::steady_clock;
  const auto deadline =
      timeout_s < 0 ? clock::time_point::max()
                    : clock::now() + std::chrono::duration_cast<clock::duration>(
                                         std::chrono::duration<double>(timeout_s));
  // Short sleeps that grow: a layer usually completes within microseconds to a few
  // milliseconds, and the sender thread must not steal a core from compute.
  auto pause = std::chrono::microseconds(5);
  while (true) {
    if (closed()) return false;
    if (events_->query(layer)) return true;
    if (clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(200));
  }
}

void LayerEventPool::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    ready_.clear();
  }
  cv_.notify_all();
}

bool LayerEventPool::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

void register_device_events_factory(c10::DeviceType type, DeviceEventsFactory factory) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[static_cast<int>(type)] = std::move(factory);
}

int64_t create_layer_event_pool(int64_t num_layers, c10::Device device) {
  TORCH_CHECK(num_layers > 0 && num_layers < (int64_t{1} << kLayerBits),
              "LayerEvents: num_layers must be in [1, ", (int64_t{1} << kLayerBits), "), got ",
              num_layers);
  auto& r = registry();
  DeviceEventsFactory factory;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(static_cast<int>(device.type()));
    if (it != r.factories.end()) factory = it->second;
  }
  std::unique_ptr<DeviceEvents> events;
  if (device.is_cpu()) {
    events = std::make_unique<CpuEvents>();
  } else {
    TORCH_CHECK(factory, "LayerEvents: device ", device,
                " is not supported by this build of torch_kvops (backend not compiled)");
    events = factory(num_layers, device);  // outside the lock: may call device APIs
  }
  std::lock_guard<std::mutex> lock(r.mu);
  const int64_t handle = r.next_handle++;
  r.pools[handle] = std::make_shared<LayerEventPool>(handle, num_layers, device, std::move(events));
  return handle;
}

bool layer_event_pool_was_closed(int64_t handle) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return handle > 0 && handle < r.next_handle && r.pools.find(handle) == r.pools.end();
}

std::shared_ptr<LayerEventPool> find_layer_event_pool(int64_t handle) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.pools.find(handle);
  return it == r.pools.end() ? nullptr : it->second;
}

std::shared_ptr<LayerEventPool> get_layer_event_pool(int64_t handle, int64_t layer,
                                                     std::optional<c10::Device> device) {
  auto pool = find_layer_event_pool(handle);
  TORCH_CHECK(pool, "LayerEvents: unknown or closed handle ", handle);
  TORCH_CHECK(layer >= 0 && layer < pool->num_layers(), "LayerEvents: layer ", layer,
              " is out of range for handle ", handle, " with ", pool->num_layers(), " layers");
  if (device) {
    TORCH_CHECK(*device == pool->device(), "LayerEvents: handle ", handle, " lives on ",
                pool->device(), " but kv_cache is on ", *device);
  }
  return pool;
}

std::shared_ptr<LayerEventPool> pool_for_op(const at::Tensor& kv_cache, int64_t handle,
                                            int64_t layer) {
  auto pool = get_layer_event_pool(handle, layer, kv_cache.device());
  pool->check_binding(layer, kv_cache.data_ptr());
  return pool;
}

void close_layer_event_pool(int64_t handle) {
  std::shared_ptr<LayerEventPool> pool;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.pools.find(handle);
    if (it == r.pools.end()) return;
    pool = it->second;
    r.pools.erase(it);
    if (!pool->device().is_cpu()) r.retired.push_back(pool);
  }
  pool->close();
}

void* pack_push_target(int64_t handle, int64_t layer) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>((handle << kLayerBits) | layer));
}

void push_packed_target(void* packed) {
  const auto bits = static_cast<int64_t>(reinterpret_cast<uintptr_t>(packed));
  const int64_t handle = bits >> kLayerBits;
  const int64_t layer = bits & ((int64_t{1} << kLayerBits) - 1);
  if (auto pool = find_layer_event_pool(handle)) pool->push(layer);
}

}  // namespace kvops
