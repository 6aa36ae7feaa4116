// Every kvops schema, in one place. Read this file as the table of contents.
//
// Mutation annotations are load-bearing: an op that returns nothing and mutates
// nothing is dead code to torch.compile and silently disappears. Marking the
// destination (or the layer's KV cache) `Tensor(a!)` keeps each op in the graph and
// orders it after the ops that wrote that tensor.
//
// Kernels: csrc/cpu (always), csrc/cuda, csrc/npu. Fake kernels and docstrings:
// torch_kvops/ops.py. Host side of LayerEvents: the pybind functions at the bottom.
#include <torch/extension.h>
#include <torch/library.h>

#include "core/layer_events.h"

TORCH_LIBRARY(kvops, m) {
  m.set_python_module("torch_kvops.ops");

  // For every layer i and row (s, d) of block_mapping ([N, 2] int64, CPU), copy block
  // s of src[i] into block d of dst[i]. One batched submission for all layers.
  m.def("swap_blocks_batch(Tensor[] src, Tensor(a!)[] dst, Tensor block_mapping) -> ()");

  // Raw form used by engines: 1-D int64 CPU tensors of addresses and byte sizes.
  // Unchecked by nature; kept in compiled graphs as an ordered effectful op (ops.py).
  m.def("swap_blocks_batch.ptrs(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes) -> ()");

  // Record layer `layer`'s event of LayerEvents `handle` on kv_cache's current stream.
  m.def("record_layer_event(Tensor(a!) kv_cache, int handle, int layer) -> ()");

  // Append `layer` to the ready queue of `handle`, in stream order (a host node while a
  // CUDA stream is capturing, so it happens on every replay).
  m.def("push_layer(Tensor(a!) kv_cache, int handle, int layer) -> ()");
}

namespace {

std::optional<int64_t> next_ready(int64_t handle, std::optional<double> timeout_s) {
  auto pool = kvops::find_layer_event_pool(handle);
  if (!pool && kvops::layer_event_pool_was_closed(handle)) return std::nullopt;
  TORCH_CHECK(pool, "LayerEvents: unknown handle ", handle);
  return pool->next_ready(timeout_s.value_or(-1.0));
}

bool wait_layer(int64_t handle, int64_t layer, std::optional<double> timeout_s) {
  if (!kvops::find_layer_event_pool(handle) && kvops::layer_event_pool_was_closed(handle)) {
    return false;
  }
  auto pool = kvops::get_layer_event_pool(handle, layer, std::nullopt);
  return pool->wait(layer, timeout_s.value_or(-1.0));
}

pybind11::dict build_info() {
  pybind11::dict info;
  info["cuda"] = static_cast<bool>(KVOPS_WITH_CUDA);
  info["npu"] = static_cast<bool>(KVOPS_WITH_NPU);
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "torch_kvops native extension: registers the kvops ops and the LayerEvents host API.";
  m.def(
      "layer_events_create",
      [](int64_t num_layers, const std::string& device) {
        return kvops::create_layer_event_pool(num_layers, c10::Device(device));
      },
      py::arg("num_layers"), py::arg("device"));
  m.def("layer_events_next_ready", &next_ready, py::arg("handle"), py::arg("timeout"),
        py::call_guard<py::gil_scoped_release>());
  m.def("layer_events_wait", &wait_layer, py::arg("handle"), py::arg("layer"), py::arg("timeout"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "layer_events_bind",
      [](int64_t handle, int64_t layer, const at::Tensor& kv_cache) {
        kvops::get_layer_event_pool(handle, layer, kv_cache.device())->bind(layer, kv_cache.data_ptr());
      },
      py::arg("handle"), py::arg("layer"), py::arg("kv_cache"));
  m.def(
      "layer_events_pushed_at",
      [](int64_t handle, int64_t layer) {
        return kvops::get_layer_event_pool(handle, layer, std::nullopt)->pushed_at(layer);
      },
      py::arg("handle"), py::arg("layer"));
  m.def("layer_events_close", &kvops::close_layer_event_pool, py::arg("handle"),
        py::call_guard<py::gil_scoped_release>());
  m.def("build_info", &build_info);
}
