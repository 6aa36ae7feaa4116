#include "block_plan.h"

#include <algorithm>
#include <sstream>

namespace kvops {
namespace {

bool device_pair_supported(c10::Device src, c10::Device dst) {
  auto is = [](c10::Device d, c10::DeviceType t) { return d.type() == t; };
  const auto cpu = c10::DeviceType::CPU;
  const auto cuda = c10::DeviceType::CUDA;
  const auto npu = c10::DeviceType::PrivateUse1;
  if (is(src, cpu) && is(dst, cpu)) return true;
  if ((is(src, cuda) || is(src, cpu)) && (is(dst, cuda) || is(dst, cpu))) return true;
  if ((is(src, npu) || is(src, cpu)) && (is(dst, npu) || is(dst, cpu))) return true;
  return false;
}

// Trailing dims must be packed so that a block is one byte range.
bool block_is_contiguous(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

size_t block_bytes(const at::Tensor& t) {
  size_t per_block = t.element_size();
  for (int64_t d = 1; d < t.dim(); ++d) per_block *= t.size(d);
  return per_block;
}

void check_same_device(const std::vector<at::Tensor>& list, const char* name) {
  for (size_t i = 1; i < list.size(); ++i) {
    TORCH_CHECK(list[i].device() == list[0].device(), "swap_blocks_batch: ", name, "[", i,
                "] is on ", list[i].device(), " but ", name, "[0] is on ", list[0].device(),
                "; all tensors of ", name, " must share one device");
  }
}

void check_layer(const at::Tensor& s, const at::Tensor& d, size_t i) {
  TORCH_CHECK(s.defined() && d.defined(), "swap_blocks_batch: layer ", i, " has an undefined tensor");
  TORCH_CHECK(s.dim() >= 1 && d.dim() >= 1, "swap_blocks_batch: src[", i, "] and dst[", i,
              "] need a block dimension (dim 0); got shapes ", s.sizes(), " and ", d.sizes());
  TORCH_CHECK(s.scalar_type() == d.scalar_type(), "swap_blocks_batch: dtype mismatch at layer ", i,
              ": src[", i, "] is ", s.scalar_type(), ", dst[", i, "] is ", d.scalar_type());
  TORCH_CHECK(block_bytes(s) == block_bytes(d), "swap_blocks_batch: bytes per block differ at layer ",
              i, ": src[", i, "] has ", block_bytes(s), " (shape ", s.sizes(), "), dst[", i, "] has ",
              block_bytes(d), " (shape ", d.sizes(), ")");
  TORCH_CHECK(block_is_contiguous(s), "swap_blocks_batch: blocks of src[", i,
              "] are not contiguous (shape ", s.sizes(), ", strides ", s.strides(), ")");
  TORCH_CHECK(block_is_contiguous(d), "swap_blocks_batch: blocks of dst[", i,
              "] are not contiguous (shape ", d.sizes(), ", strides ", d.strides(), ")");
}

void append_merged(std::vector<CopyDesc>& out, uintptr_t src, uintptr_t dst, size_t bytes) {
  if (bytes == 0) return;
  if (!out.empty()) {
    CopyDesc& last = out.back();
    if (last.src + last.bytes == src && last.dst + last.bytes == dst) {
      last.bytes += bytes;
      return;
    }
  }
  out.push_back({src, dst, bytes});
}

void check_ptr_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "swap_blocks_batch.ptrs: ", name, " must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, "swap_blocks_batch.ptrs: ", name, " must be int64, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1, "swap_blocks_batch.ptrs: ", name, " must be 1-D, got shape ", t.sizes());
}

}  // namespace

BlockCopyLayout validate_block_copies(const std::vector<at::Tensor>& src,
                                      const std::vector<at::Tensor>& dst,
                                      const at::Tensor& block_mapping) {
  TORCH_CHECK(src.size() == dst.size(), "swap_blocks_batch: src has ", src.size(),
              " tensors but dst has ", dst.size());
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong,
              "swap_blocks_batch: block_mapping must be int64, got ", block_mapping.scalar_type());
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "swap_blocks_batch: block_mapping must have shape [N, 2], got ", block_mapping.sizes());
  TORCH_CHECK(block_mapping.device().is_cpu(),
              "swap_blocks_batch: block_mapping must be on the CPU, got ", block_mapping.device());

  BlockCopyLayout layout;
  if (src.empty()) return layout;
  check_same_device(src, "src");
  check_same_device(dst, "dst");
  layout.src_device = src[0].device();
  layout.dst_device = dst[0].device();
  TORCH_CHECK(device_pair_supported(layout.src_device, layout.dst_device),
              "swap_blocks_batch: unsupported device pair ", layout.src_device, " -> ",
              layout.dst_device);
  for (size_t i = 0; i < src.size(); ++i) check_layer(src[i], dst[i], i);

  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t rows = mapping.size(0);
  if (rows == 0) return layout;
  const int64_t* m = mapping.data_ptr<int64_t>();

  // Every index against every layer, before any byte moves: one pass for the extremes,
  // then O(1) per layer; the rows are scanned again only to name a bad one.
  int64_t min_src = m[0], max_src = m[0], min_dst = m[1], max_dst = m[1];
  for (int64_t r = 1; r < rows; ++r) {
    min_src = std::min(min_src, m[2 * r]);
    max_src = std::max(max_src, m[2 * r]);
    min_dst = std::min(min_dst, m[2 * r + 1]);
    max_dst = std::max(max_dst, m[2 * r + 1]);
  }
  for (size_t i = 0; i < src.size(); ++i) {
    const int64_t ns = src[i].size(0), nd = dst[i].size(0);
    if (min_src >= 0 && max_src < ns && min_dst >= 0 && max_dst < nd) continue;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = m[2 * r], d = m[2 * r + 1];
      TORCH_CHECK(s >= 0 && s < ns, "swap_blocks_batch: block_mapping[", r, "] = (", s, ", ", d,
                  "): source block ", s, " is out of range for src[", i, "] with ", ns, " blocks");
      TORCH_CHECK(d >= 0 && d < nd, "swap_blocks_batch: block_mapping[", r, "] = (", s, ", ", d,
                  "): destination block ", d, " is out of range for dst[", i, "] with ", nd,
                  " blocks");
    }
  }
  std::vector<int64_t> first_row(static_cast<size_t>(max_dst + 1), -1);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t d = m[2 * r + 1];
    TORCH_CHECK(first_row[d] < 0, "swap_blocks_batch: destination block ", d,
                " is named twice in block_mapping (rows ", first_row[d], " and ", r, ")");
    first_row[d] = r;
  }
  // Copying within one cache: a block that is both read and written would make the
  // result depend on copy order, which the batched engines do not guarantee.
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i].data_ptr() != dst[i].data_ptr()) continue;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = m[2 * r];
      TORCH_CHECK(s > max_dst || first_row[s] < 0, "swap_blocks_batch: block ", s,
                  " of layer ", i, " is both a source (row ", r, ") and a destination (row ",
                  first_row[s], ") of one in-place copy");
    }
  }

  layout.layers.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    layout.layers.push_back({reinterpret_cast<uintptr_t>(src[i].data_ptr()),
                             reinterpret_cast<uintptr_t>(dst[i].data_ptr()),
                             static_cast<size_t>(src[i].stride(0) * src[i].element_size()),
                             static_cast<size_t>(dst[i].stride(0) * dst[i].element_size()),
                             block_bytes(src[i])});
  }
  layout.mapping = mapping;
  layout.rows = rows;
  return layout;
}

CopyPlan plan_block_copies(const std::vector<at::Tensor>& src,
                           const std::vector<at::Tensor>& dst,
                           const at::Tensor& block_mapping) {
  const BlockCopyLayout layout = validate_block_copies(src, dst, block_mapping);
  CopyPlan plan;
  plan.src_device = layout.src_device;
  plan.dst_device = layout.dst_device;
  const int64_t rows = layout.rows;
  if (rows == 0) return plan;
  const int64_t* m = layout.rows_ptr();
  plan.descs.reserve(static_cast<size_t>(rows) * layout.layers.size());
  for (const LayerCopy& l : layout.layers) {
    for (int64_t r = 0; r < rows; ++r) {
      append_merged(plan.descs, l.src_base + m[2 * r] * l.src_stride,
                    l.dst_base + m[2 * r + 1] * l.dst_stride, l.bytes);
    }
    plan.total_bytes += l.bytes * rows;
  }
  return plan;
}

std::vector<CopyDesc> plan_ptr_copies(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                                      const at::Tensor& sizes) {
  check_ptr_tensor(src_ptrs, "src_ptrs");
  check_ptr_tensor(dst_ptrs, "dst_ptrs");
  check_ptr_tensor(sizes, "sizes");
  TORCH_CHECK(src_ptrs.numel() == dst_ptrs.numel() && dst_ptrs.numel() == sizes.numel(),
              "swap_blocks_batch.ptrs: src_ptrs, dst_ptrs and sizes must have equal lengths, got ",
              src_ptrs.numel(), ", ", dst_ptrs.numel(), " and ", sizes.numel());
  const at::Tensor s = src_ptrs.contiguous(), d = dst_ptrs.contiguous(), n = sizes.contiguous();
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* dp = d.data_ptr<int64_t>();
  const int64_t* np = n.data_ptr<int64_t>();
  for (int64_t k = 0; k < n.numel(); ++k) {
    TORCH_CHECK(np[k] >= 0, "swap_blocks_batch.ptrs: sizes[", k, "] = ", np[k], " is negative");
    TORCH_CHECK(np[k] == 0 || (sp[k] != 0 && dp[k] != 0), "swap_blocks_batch.ptrs: copy ", k,
                " has a null address");
  }
  std::vector<CopyDesc> out;
  out.reserve(n.numel());
  for (int64_t k = 0; k < n.numel(); ++k) {
    append_merged(out, static_cast<uintptr_t>(sp[k]), static_cast<uintptr_t>(dp[k]),
                  static_cast<size_t>(np[k]));
  }
  return out;
}

namespace {
std::vector<PtrCopier>& copier_registry() {
  static std::vector<PtrCopier> copiers;
  return copiers;
}
}  // namespace

void register_ptr_copier(PtrCopier copier) { copier_registry().push_back(copier); }
const std::vector<PtrCopier>& ptr_copiers() { return copier_registry(); }

}  // namespace kvops
