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

#include "core/block_plan.h"
#include "core/copy_policy.h"
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

  // A 128-bit checksum (four CRC-32C lanes, seeded by `seed`) of each block named in
  // block_ids (1-D int64, CPU) of `cache` (dim 0 = block, each block contiguous):
  // uint8 [len(block_ids), 16]. On the calling thread, or with `parallel` on torch's
  // intra-op threads; the GIL is released either way.
  m.def("block_digests(Tensor cache, Tensor block_ids, int seed, bool parallel=False) -> Tensor");
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

pybind11::dict policy_to_dict(const kvops::CopyPolicy& p) {
  pybind11::dict d;
  d["mode"] = kvops::copy_mode_name(p.mode);
  d["max_ctas"] = p.max_ctas;
  d["dma_min_bytes"] = p.dma_min_bytes;
  d["dma_min_bytes_d2d"] = p.dma_min_bytes_d2d;
  return d;
}

// Starts from `base` and replaces the fields that are given.
kvops::CopyPolicy policy_with(kvops::CopyPolicy p, const std::optional<std::string>& mode,
                              std::optional<int64_t> max_ctas, std::optional<int64_t> dma_min_bytes,
                              std::optional<int64_t> dma_min_bytes_d2d) {
  if (mode) p.mode = kvops::parse_copy_mode(*mode, "copy policy mode");
  if (max_ctas) {
    TORCH_CHECK(*max_ctas >= 1 && *max_ctas <= (1 << 20),
                "copy policy: max_ctas must be in [1, 1048576], got ", *max_ctas);
    p.max_ctas = static_cast<int>(*max_ctas);
  }
  if (dma_min_bytes) {
    TORCH_CHECK(*dma_min_bytes >= 0, "copy policy: dma_min_bytes must be >= 0, got ", *dma_min_bytes);
    p.dma_min_bytes = static_cast<size_t>(*dma_min_bytes);
  }
  if (dma_min_bytes_d2d) {
    TORCH_CHECK(*dma_min_bytes_d2d >= 0, "copy policy: dma_min_bytes_d2d must be >= 0, got ",
                *dma_min_bytes_d2d);
    p.dma_min_bytes_d2d = static_cast<size_t>(*dma_min_bytes_d2d);
  }
  return p;
}

// Test hook: the CUDA copy plan for raw descriptors (merged as the .ptrs op merges
// them), computed without a GPU. Addresses are never dereferenced.
pybind11::dict plan_cuda_copy_for_test(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                                       const at::Tensor& sizes, bool src_kernel_ok,
                                       bool dst_kernel_ok, bool device_to_device, bool capturing,
                                       bool large_params, bool dma_batched,
                                       const std::optional<std::string>& mode,
                                       std::optional<int64_t> max_ctas,
                                       std::optional<int64_t> dma_min_bytes,
                                       std::optional<int64_t> dma_min_bytes_d2d) {
  const std::vector<kvops::CopyDesc> descs = kvops::plan_ptr_copies(src_ptrs, dst_ptrs, sizes);
  kvops::CopyContext ctx;
  ctx.src_kernel_ok = src_kernel_ok;
  ctx.dst_kernel_ok = dst_kernel_ok;
  ctx.device_to_device = device_to_device;
  ctx.capturing = capturing;
  ctx.large_params = large_params;
  ctx.dma_batched = dma_batched;
  const kvops::CopyPolicy policy =
      policy_with(kvops::copy_policy(), mode, max_ctas, dma_min_bytes, dma_min_bytes_d2d);
  const kvops::CudaCopyPlan plan = kvops::plan_cuda_copy(descs, ctx, policy);
  namespace py = pybind11;
  py::list merged, paths, items, launches, dma;
  for (const auto& d : descs) merged.append(py::make_tuple(d.src, d.dst, d.bytes));
  for (auto p : plan.path) paths.append(p == kvops::CopyPath::kKernel ? "kernel" : "dma");
  for (const auto& d : plan.items) items.append(py::make_tuple(d.src, d.dst, d.bytes));
  for (const auto& d : plan.dma) dma.append(py::make_tuple(d.src, d.dst, d.bytes));
  for (const auto& l : plan.launches) {
    py::dict ld;
    ld["first_item"] = l.first_item;
    ld["items"] = l.items;
    ld["grid"] = l.grid;
    ld["by_value"] = l.by_value;
    launches.append(ld);
  }
  py::dict out;
  out["descs"] = merged;
  out["paths"] = paths;
  out["items"] = items;
  out["launches"] = launches;
  out["dma"] = dma;
  out["kernel_bytes"] = plan.kernel_bytes;
  out["dma_bytes"] = plan.dma_bytes;
  out["policy"] = policy_to_dict(policy);
  return out;
}

}  // namespace

#if KVOPS_WITH_CUDA
namespace kvops {
// csrc/cuda/kvops_cuda.cu: C++ baselines for the benchmark (not part of the op API).
double bench_memcpy_loop(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                         const at::Tensor& sizes);
double bench_memcpy_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                          const at::Tensor& sizes);
}  // namespace kvops
#endif

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

  // Copy policy of the CUDA backend (torch_kvops.set_copy_policy wraps these).
  m.def("_get_copy_policy", [] { return policy_to_dict(kvops::copy_policy()); });
  m.def(
      "_set_copy_policy",
      [](const std::optional<std::string>& mode, std::optional<int64_t> max_ctas,
         std::optional<int64_t> dma_min_bytes, std::optional<int64_t> dma_min_bytes_d2d) {
        kvops::set_copy_policy(
            policy_with(kvops::copy_policy(), mode, max_ctas, dma_min_bytes, dma_min_bytes_d2d));
      },
      py::arg("mode") = py::none(), py::arg("max_ctas") = py::none(),
      py::arg("dma_min_bytes") = py::none(), py::arg("dma_min_bytes_d2d") = py::none());
  m.def("_copy_policy_from_env", [] { return policy_to_dict(kvops::copy_policy_from_env()); });
  m.def("_plan_cuda_copy", &plan_cuda_copy_for_test, py::arg("src_ptrs"), py::arg("dst_ptrs"),
        py::arg("sizes"), py::arg("src_kernel_ok") = true, py::arg("dst_kernel_ok") = true,
        py::arg("device_to_device") = false, py::arg("capturing") = false,
        py::arg("large_params") = true, py::arg("dma_batched") = true, py::arg("mode") = py::none(),
        py::arg("max_ctas") = py::none(), py::arg("dma_min_bytes") = py::none(),
        py::arg("dma_min_bytes_d2d") = py::none());
  m.def("_kernel_constants", [] {
    pybind11::dict d;
    d["threads"] = kvops::kKernelThreads;
    d["warps_per_cta"] = kvops::kKernelWarpsPerCta;
    d["item_bytes"] = kvops::kKernelItemBytes;
    d["items_by_value_small"] = kvops::kItemsByValueSmall;
    d["items_by_value_large"] = kvops::kItemsByValueLarge;
    return d;
  });
#if KVOPS_WITH_CUDA
  // Benchmark baselines written like the engines' own C++ (per-block cudaMemcpyAsync
  // loop = vLLM's old swap_blocks; cuMemcpyBatchAsync = its swap_blocks_batch). Both
  // issue on the current stream and return the host submission time in seconds.
  m.def("_bench_memcpy_loop", &kvops::bench_memcpy_loop, py::arg("src_ptrs"),
        py::arg("dst_ptrs"), py::arg("sizes"));
  m.def("_bench_memcpy_batch", &kvops::bench_memcpy_batch, py::arg("src_ptrs"),
        py::arg("dst_ptrs"), py::arg("sizes"));
#endif
}
