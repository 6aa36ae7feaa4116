// CPU kernel of kvops::block_digests: a 128-bit checksum per KV block (the connector's
// integrity_check="checksum", torch_kvops/connector/integrity.py).
//
// The digest of a block is four CRC-32C (Castagnoli) values, one per quarter of the
// block's bytes (the last quarter takes the remainder), each started from a value
// derived from `seed` and the quarter's index. Four independent CRC chains keep the
// CPU's CRC unit busy (the crc32 instruction has a latency of 3 cycles and a
// throughput of 1 per cycle on x86), so no CRC-combining arithmetic is needed; the
// four CRCs together detect what CRC-32C detects in each quarter and make a misplaced
// block pass with a chance of about 2^-128. Not a MAC: anyone who knows the bytes can
// compute it (integrity_check="mac" is the keyed mode).
//
// x86-64 with SSE4.2: the crc32 instruction (selected at run time); elsewhere a
// slicing-by-8 table. Both give the same values (checked once, on first use).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <mutex>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define KVOPS_HAVE_SSE42_PATH 1
#else
#define KVOPS_HAVE_SSE42_PATH 0
#endif

namespace kvops {
namespace {

constexpr int kLanes = 4;
constexpr int64_t kDigestBytes = 4 * kLanes;

using Table = std::array<std::array<uint32_t, 256>, 8>;

Table make_table() {
  Table t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
  return t;
}

const Table& table() {
  static const Table t = make_table();
  return t;
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // unaligned-safe; the crc is defined on little-endian words
  return v;
}

// One lane's update over n bytes, slicing-by-8 (any CPU).
uint32_t crc_soft(uint32_t crc, const uint8_t* p, size_t n) {
  const Table& t = table();
  while (n >= 8) {
    const uint64_t v = load64(p) ^ crc;
    crc = t[7][v & 0xFF] ^ t[6][(v >> 8) & 0xFF] ^ t[5][(v >> 16) & 0xFF] ^
          t[4][(v >> 24) & 0xFF] ^ t[3][(v >> 32) & 0xFF] ^ t[2][(v >> 40) & 0xFF] ^
          t[1][(v >> 48) & 0xFF] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

// Initial CRC of each lane: depends on the seed (the layer), so a block's bytes do
// not pass for another layer's.
inline uint32_t lane_init(int64_t seed, int lane) {
  uint64_t x = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(lane + 1);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint32_t>(x) ^ 0xFFFFFFFFu;
}

struct Lanes {
  const uint8_t* p[kLanes];
  size_t n[kLanes];
};

Lanes split(const uint8_t* block, size_t bytes) {
  Lanes l{};
  const size_t quarter = bytes / kLanes / 8 * 8;  // whole words, the last lane takes the rest
  for (int k = 0; k < kLanes; ++k) {
    l.p[k] = block + k * quarter;
    l.n[k] = k + 1 < kLanes ? quarter : bytes - (kLanes - 1) * quarter;
  }
  return l;
}

void digest_soft(const uint8_t* block, size_t bytes, int64_t seed, uint32_t* out) {
  const Lanes l = split(block, bytes);
  for (int k = 0; k < kLanes; ++k) out[k] = crc_soft(lane_init(seed, k), l.p[k], l.n[k]) ^ 0xFFFFFFFFu;
}

#if KVOPS_HAVE_SSE42_PATH
__attribute__((target("sse4.2"))) void digest_sse42(const uint8_t* block, size_t bytes, int64_t seed,
                                                     uint32_t* out) {
  const Lanes l = split(block, bytes);
  uint64_t c[kLanes];
  for (int k = 0; k < kLanes; ++k) c[k] = lane_init(seed, k);
  const size_t words = l.n[0] / 8;  // the first three lanes hold exactly this many words
  for (size_t i = 0; i < words; ++i) {
    c[0] = _mm_crc32_u64(c[0], load64(l.p[0] + 8 * i));
    c[1] = _mm_crc32_u64(c[1], load64(l.p[1] + 8 * i));
    c[2] = _mm_crc32_u64(c[2], load64(l.p[2] + 8 * i));
    c[3] = _mm_crc32_u64(c[3], load64(l.p[3] + 8 * i));
  }
  // the last lane's remainder (bytes not a multiple of 32)
  const uint8_t* p = l.p[3] + 8 * words;
  size_t n = l.n[3] - 8 * words;
  for (; n >= 8; n -= 8, p += 8) c[3] = _mm_crc32_u64(c[3], load64(p));
  uint32_t last = static_cast<uint32_t>(c[3]);
  for (; n; --n) last = _mm_crc32_u8(last, *p++);
  c[3] = last;
  for (int k = 0; k < kLanes; ++k) out[k] = static_cast<uint32_t>(c[k]) ^ 0xFFFFFFFFu;
}
#endif

using DigestFn = void (*)(const uint8_t*, size_t, int64_t, uint32_t*);

DigestFn pick_digest() {
#if KVOPS_HAVE_SSE42_PATH
  if (__builtin_cpu_supports("sse4.2")) {
    // Both paths must agree: digests cross machines. Checked once on odd sizes.
    uint8_t buf[1031];
    for (size_t i = 0; i < sizeof(buf); ++i) buf[i] = static_cast<uint8_t>(i * 131 + 7);
    for (size_t n : {size_t{0}, size_t{5}, size_t{37}, size_t{1024}, sizeof(buf)}) {
      uint32_t a[kLanes], b[kLanes];
      digest_soft(buf, n, 3, a);
      digest_sse42(buf, n, 3, b);
      TORCH_CHECK(std::memcmp(a, b, sizeof(a)) == 0,
                  "block_digests: the SSE4.2 CRC-32C disagrees with the table one (n=", n, ")");
    }
    return &digest_sse42;
  }
#endif
  return &digest_soft;
}

DigestFn digest_fn() {
  static const DigestFn fn = pick_digest();
  return fn;
}

at::Tensor block_digests_cpu(const at::Tensor& cache, const at::Tensor& block_ids, int64_t seed,
                             bool parallel) {
  TORCH_CHECK(cache.device().is_cpu(), "block_digests: cache must be on the CPU, got ", cache.device());
  TORCH_CHECK(cache.dim() >= 1, "block_digests: cache must have a block dimension (dim 0)");
  TORCH_CHECK(block_ids.device().is_cpu() && block_ids.scalar_type() == at::kLong && block_ids.dim() == 1,
              "block_digests: block_ids must be a 1-D int64 CPU tensor, got ", block_ids.scalar_type(),
              " of shape ", block_ids.sizes(), " on ", block_ids.device());
  // Each block must be one contiguous run of bytes; blocks may be apart (a strided dim 0).
  TORCH_CHECK(cache.size(0) == 0 || cache.dim() == 1 || cache.select(0, 0).is_contiguous(),
              "block_digests: each block (cache[k]) must be contiguous");
  const int64_t num_blocks = cache.size(0);
  const size_t block_bytes = static_cast<size_t>(cache.numel() / std::max<int64_t>(num_blocks, 1)) *
                             cache.element_size();
  const int64_t pitch = cache.stride(0) * static_cast<int64_t>(cache.element_size());
  const at::Tensor ids = block_ids.contiguous();
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_blocks, "block_digests: block_ids[", i, "] = ", id[i],
                " is out of range (the cache has ", num_blocks, " blocks)");
  }
  at::Tensor out = at::empty({n, kDigestBytes}, block_ids.options().dtype(at::kByte));
  if (n == 0) return out;
  const uint8_t* base = static_cast<const uint8_t*>(cache.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const DigestFn fn = digest_fn();
  // About 256 KiB per task: a block per task would spend more on wake-ups than on hashing.
  const int64_t grain = std::max<int64_t>(1, static_cast<int64_t>((size_t{256} << 10) / std::max<size_t>(block_bytes, 1)));
  auto hash_range = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      uint32_t crc[kLanes];
      fn(base + id[i] * pitch, block_bytes, seed, crc);
      for (int k = 0; k < kLanes; ++k) {
        for (int b = 0; b < 4; ++b) dst[i * kDigestBytes + 4 * k + b] = static_cast<uint8_t>(crc[k] >> (8 * b));
      }
    }
  };
  // Serial by default: the connector hashes on its own worker threads, next to the
  // transport's; an OpenMP team started from such a thread spin-waits after each call
  // and took CPU from the transfer (0.63x against 0.83x of the push on 2 cores).
  if (parallel) {
    at::parallel_for(0, n, grain, hash_range);
  } else {
    hash_range(0, n);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CPU, m) { m.impl("block_digests", &block_digests_cpu); }

}  // namespace kvops
