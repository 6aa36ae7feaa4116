#include "copy_policy.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <optional>

namespace kvops {
namespace {

std::mutex& policy_mutex() {
  static std::mutex m;
  return m;
}

void validate(const CopyPolicy& p) {
  TORCH_CHECK(p.max_ctas >= 1 && p.max_ctas <= (1 << 20),
              "kvops copy policy: max_ctas must be in [1, 1048576], got ", p.max_ctas);
}

size_t parse_size(const char* name, const char* text) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text, &end, 10);
  TORCH_CHECK(errno == 0 && end != text && *end == '\0' && v >= 0, name, "='", text,
              "' is not a non-negative integer");
  return static_cast<size_t>(v);
}

// Empty until the first copy reads the environment (a bad value raises there, on
// every copy, until set_copy_policy replaces it) or set_copy_policy sets it.
std::optional<CopyPolicy>& current() {
  static std::optional<CopyPolicy> policy;
  return policy;
}

}  // namespace

const char* copy_mode_name(CopyMode mode) {
  switch (mode) {
    case CopyMode::kAuto: return "auto";
    case CopyMode::kKernel: return "kernel";
    case CopyMode::kDma: return "dma";
  }
  return "?";
}

CopyMode parse_copy_mode(const std::string& text, const char* what) {
  if (text == "auto") return CopyMode::kAuto;
  if (text == "kernel") return CopyMode::kKernel;
  if (text == "dma") return CopyMode::kDma;
  TORCH_CHECK(false, what, ": '", text, "' is not one of auto, kernel, dma");
}

CopyPolicy copy_policy_from_env() {
  CopyPolicy p;
  if (const char* v = std::getenv("KVOPS_CUDA_COPY")) p.mode = parse_copy_mode(v, "KVOPS_CUDA_COPY");
  if (const char* v = std::getenv("KVOPS_CUDA_COPY_MAX_CTAS")) {
    const size_t n = parse_size("KVOPS_CUDA_COPY_MAX_CTAS", v);
    TORCH_CHECK(n >= 1 && n <= (size_t{1} << 20), "KVOPS_CUDA_COPY_MAX_CTAS='", v,
                "' must be in [1, 1048576]");
    p.max_ctas = static_cast<int>(n);
  }
  if (const char* v = std::getenv("KVOPS_CUDA_DMA_MIN_BYTES")) {
    p.dma_min_bytes = parse_size("KVOPS_CUDA_DMA_MIN_BYTES", v);
  }
  if (const char* v = std::getenv("KVOPS_CUDA_DMA_MIN_BYTES_D2D")) {
    p.dma_min_bytes_d2d = parse_size("KVOPS_CUDA_DMA_MIN_BYTES_D2D", v);
  }
  validate(p);
  return p;
}

CopyPolicy copy_policy() {
  std::lock_guard<std::mutex> lock(policy_mutex());
  if (!current()) current() = copy_policy_from_env();
  return *current();
}

void set_copy_policy(const CopyPolicy& policy) {
  validate(policy);
  std::lock_guard<std::mutex> lock(policy_mutex());
  current() = policy;
}

CudaCopyPlan plan_cuda_copy(const std::vector<CopyDesc>& descs, const CopyContext& ctx,
                            const CopyPolicy& policy) {
  validate(policy);
  CudaCopyPlan plan;
  plan.path.reserve(descs.size());
  const bool kernel_can = ctx.src_kernel_ok && ctx.dst_kernel_ok;
  const size_t threshold = ctx.device_to_device ? policy.dma_min_bytes_d2d : policy.dma_min_bytes;
  for (const CopyDesc& d : descs) {
    bool kernel = false;
    if (kernel_can && d.bytes > 0) {
      switch (policy.mode) {
        case CopyMode::kKernel: kernel = true; break;
        case CopyMode::kDma: kernel = false; break;
        case CopyMode::kAuto:
          kernel = d.bytes < threshold || (!ctx.dma_batched && !ctx.device_to_device);
          break;
      }
    }
    plan.path.push_back(kernel ? CopyPath::kKernel : CopyPath::kDma);
    if (!kernel) {
      if (d.bytes > 0) plan.dma.push_back(d);
      plan.dma_bytes += d.bytes;
      continue;
    }
    plan.kernel_bytes += d.bytes;
    for (size_t off = 0; off < d.bytes; off += kKernelItemBytes) {
      plan.items.push_back({d.src + off, d.dst + off, std::min(kKernelItemBytes, d.bytes - off)});
    }
  }
  const size_t n = plan.items.size();
  if (n == 0) return plan;
  const size_t per_launch = ctx.large_params ? kItemsByValueLarge : kItemsByValueSmall;
  auto grid_for = [&](size_t items) {
    const size_t want = (items + kKernelWarpsPerCta - 1) / kKernelWarpsPerCta;
    return static_cast<int>(std::max<size_t>(1, std::min<size_t>(want, policy.max_ctas)));
  };
  if (n <= per_launch || ctx.capturing) {
    for (size_t first = 0; first < n; first += per_launch) {
      const size_t items = std::min(per_launch, n - first);
      plan.launches.push_back({first, items, grid_for(items), true});
    }
  } else {
    plan.launches.push_back({0, n, grid_for(n), false});
  }
  return plan;
}

}  // namespace kvops
