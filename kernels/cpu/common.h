// Shared by the CPU kernels: scalar conversions the compiler can vectorize, and a vectorizable exp.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LLM_HAVE_AMX 1
#else
#define LLM_HAVE_AMX 0
#endif
#if LLM_HAVE_AMX && defined(__AMX_INT8__)
#define LLM_HAVE_AMX_INT8 1
#else
#define LLM_HAVE_AMX_INT8 0
#endif

namespace llm_cpu {

// An uninitialized tensor for what decode steps read from memory (packed weights, the paged KV pool), on 2 MiB
// pages where it spans at least one: its own anonymous mapping, aligned to 2 MiB and marked MADV_HUGEPAGE before
// its first write, so the kernel backs it with transparent huge pages where it can (THP "madvise" mode included)
// and falls back to 4 KiB pages where it cannot (torch's allocator where the mapping itself fails). With
// `whole_last_page` the size is rounded up to whole 2 MiB pages (up to 2 MiB more resident per tensor); without it
// the part past the last whole 2 MiB page stays on 4 KiB pages (nothing resident beyond the tensor). A stream of
// 4 KiB pages stalls the hardware prefetchers at every page boundary and walks the page table every 4 KiB: on a
// Zen 4 EPYC a loop of AVX-512 loads over a 2 GiB buffer read 29 GB/s on 2 threads from 4 KiB pages and 36 GB/s
// from 2 MiB ones.
inline torch::Tensor empty_on_huge_pages(at::IntArrayRef sizes, at::TensorOptions options,
                                         bool whole_last_page = true) {
  constexpr size_t kHugePageBytes = size_t{2} << 20;
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (bytes < kHugePageBytes) return torch::empty(sizes, options);
  const size_t rounded = (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1);  // the last page a whole one too
  const size_t length = rounded + kHugePageBytes;  // room to align the start up to 2 MiB
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return torch::empty(sizes, options);
  char* data = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHugePageBytes - 1)
                                       & ~(kHugePageBytes - 1));
  // A hint: where it is refused, the pages are 4 KiB ones.
  madvise(data, whole_last_page ? rounded : bytes & ~(kHugePageBytes - 1), MADV_HUGEPAGE);
  return torch::from_blob(data, sizes, [base, length](void*) { munmap(base, length); }, options);
}

// bfloat16 values are handled as their raw bits: the compiler vectorizes loads, stores and conversions of
// uint16_t, not of c10::BFloat16 (a class).
using bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Rounds to T as torch does (round to nearest, ties to even), so a fused kernel rounds where eager torch
// would. The bf16 case is integer arithmetic on the bits, which the compiler vectorizes.
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }
template <>
inline bf16 from_float<bf16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<bf16>(bits >> 16);
}

// Rounds through T and back: the value eager torch holds after an operation whose result has dtype T.
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }
template <>
inline float round_to<float>(float x) { return x; }

// e^x for x <= 0, written so the compiler can vectorize it (std::exp is a scalar call per element):
// 2^(x log2 e) split into an integer power, set in the exponent bits, and a degree-6 polynomial for 2^f,
// f in [0, 1); relative error below 2e-7.
// The polynomial's coefficients, highest degree first (Horner's scheme), shared by the vector forms.
constexpr float EXP2_POLY[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};

inline float exp_nonpositive(float x) {
  float y = std::max(x * 1.44269504088896341f, -126.f);
  float n = std::floor(y);
  float f = y - n;
  float p = EXP2_POLY[0];
  for (int i = 1; i < 7; ++i) p = p * f + EXP2_POLY[i];
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if LLM_HAVE_AMX
// The tile configuration `_tile_loadconfig` reads (palette 1): bytes per row and rows of each of the 8 tiles.
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#endif

// Whether this build and this process can use AMX tiles (Linux grants the tile state on request, once).
inline bool amx_usable() {
#if LLM_HAVE_AMX
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#else
  return false;
#endif
}

// Calls body(T* tag) with the C++ element type of a float32, bfloat16 (as bf16 bits) or float16 tensor.
template <typename Body>
void dispatch_float_types(at::ScalarType type, const char* name, Body body) {
  switch (type) {
    case at::kFloat: body(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: body(static_cast<bf16*>(nullptr)); break;
    case at::kHalf: body(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", type);
  }
}

// f(std::integral_constant<int, N>{}) for N = n clamped to [1, MAX]: a run-time count (the rows of a register block,
// the query heads of a KV head) as a compile-time constant, so that loops over it unroll and their accumulators
// stay in registers.
template <int MAX, typename F>
inline void with_constant(int64_t n, F&& f) {
  static_assert(MAX >= 1, "with_constant: MAX must be at least 1");
  if constexpr (MAX > 1) {
    if (n < MAX) return with_constant<MAX - 1>(n, f);
  }
  return f(std::integral_constant<int, MAX>{});
}

}  // namespace llm_cpu
