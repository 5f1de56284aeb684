// Weight-only int8 GEMMs ("W8A16"): y = x * dequant(W)^T + bias with W stored as int8 per output channel, symmetric
// (w[n][k] = scale[n] * q[n][k], q in [-127, 127]), for the rows of decode steps and, chunk by chunk, prompts.
// A decode step of a 0.5-3B model is bound by reading its weights (small_gemm.cpp): int8 weights are half the bytes
// of bf16, so the step reads half as much. The idea is weight-only per-channel quantization as in LLM.int8()
// (Dettmers et al., NeurIPS 2022, sec. 3.1, vector-wise quantization) and the W8A16 paths of vLLM and TensorRT-LLM.
// The weights are packed at load into small_gemm's bf16 tile layout, one byte per weight: per block of 16 outputs,
// K / 2 runs of 32 int8 (each output's two consecutive k), followed by the block's 16 fp32 scales (64 bytes), so a
// thread streams a block's weights and then its scales in one run. In registers each run widens int8 -> int32 ->
// fp32 (vpmovsxbd, vcvtdq2ps) and goes into register blocks like small_gemm's: for bf16 activations it is rounded to
// bf16 (exact for |q| <= 127) and multiplied with AVX512-BF16's vdpbf16ps, 32 multiply-adds an instruction, 12 rows
// by 2 blocks of 16 outputs (each widened vector serves 12 rows: the widening costs about as much as the products);
// for fp32 activations with fp32 multiply-adds, 6 rows by 2 blocks. The sums are exact products of x and the
// integers, accumulated in fp32 and scaled once per output at the end; results are rounded to x's dtype once.
// On AVX2 with FMA (no AVX-512) there is no instruction that multiplies bf16, and widening each weight to fp32 for an
// FMA costs more than the FMA itself: at one row the kernel was bound by those instructions, not by memory. So fp32
// rows are rounded to int16 once per call (a scale per row: max |x| / 32767, so each activation is within 1.5e-5 of
// the row's largest, finer than bf16's 8 bits for all but the row's smallest values) and multiplied with vpmaddwd,
// 16 int8 weights widened to int16 per instruction pair, summed exactly in int32 over runs of 256 k pairs and in fp32
// across runs; one row takes four blocks at a time, two rows two. The idea is the integer dot products of llama.cpp's
// Q8_0 and vLLM's W8A8 with finer activations (their 8 bits per activation would add error; see configuration.md).
// W8A8 (int8_gemm with int8_activations, AVX512-VNNI): the activations are rounded to int8 too, with a scale per
// row and group of W8A8_GROUP k (as llama.cpp rounds activations to Q8_0 blocks of 32 for its integer dot products;
// one scale per whole row, as in vLLM's dynamic per-token W8A8, cost SmolLM2-135M 2.9% perplexity over bf16 where
// a group of 64 cost 0.6%, simulated on the same 2,044 tokens; on 32,704 tokens the kernel's cost is 0.62%), and
// vpdpbusd multiplies 4 k of 16 outputs per instruction, 64 multiply-adds, with no widening of the weights.
// vpdpbusd multiplies unsigned bytes by signed ones: the weights are taken as unsigned q + 128 (their sign bit
// flipped), so each group's sum carries 128 x the group's activation sum, computed once per
// row and group when the row is rounded and set as the group's starting sum (the sums over the weights instead
// would be one per output and group: carried through the passes they cost a sixth of the time at 64 rows).
#include "common.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLM_HAVE_AVX512_VNNI 1
#else
#define LLM_HAVE_AVX512_VNNI 0
#endif

namespace llm_cpu {
namespace {

constexpr int64_t INT8_GEMM_MAX_ROWS = 256;  // rows one call takes (the Python side chunks longer prompts)
constexpr int64_t INT8_SCALE_BYTES = 16 * sizeof(float);  // the 16 fp32 scales after each block's weights
// bf16 activations of at least this many rows (prompt chunks) widen each group's weights once, into a per-thread
// buffer of STAGED_PAIRS k pairs at a time (4 blocks: 128 KiB, in L2), instead of once per pass of 6 rows; below it
// the buffer's extra writes and reads cost more than the conversions they save (measured on AVX512-BF16 Zen 4).
constexpr int64_t STAGED_MIN_ROWS = 128;
constexpr int64_t STAGED_PAIRS = 512;
constexpr int64_t W8A8_GROUP = 64;  // k per activation scale (W8A8)

#if LLM_HAVE_AVX512
// A k pair's 16 outputs of a block (32 int8 at w: output n's pair at bytes 2n, 2n + 1) widened to fp32:
// lo = outputs 0..7, hi = outputs 8..15, each lane pair (k even, k odd).
inline void widen_pair(const int8_t* w, __m512& lo, __m512& hi) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
}

// fp32 rows x[0..MB) against NB consecutive int8 blocks (block j at w + j * stride bytes: K / 2 pairs of 32 int8,
// then 16 fp32 scales): c[m * 64 + 16 * j + n] = scale_j[n] * sum_k x[m][k] q_j[n][k]. Each lane sums one output's
// even or odd k (the row's pair broadcast); the two are added at the end.
template <int MB, int NB>
inline void int8_block_fp32(const float* x, int64_t K, const int8_t* w, int64_t stride, float* c,
                            const char* pf = nullptr, int64_t pf_lines = 0) {
  const int64_t pf_step = pf ? (pf_lines + K / 2 - 1) / (K / 2) : 0;
  __m512 acc[MB][NB][2];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j][0] = acc[m][j][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    prefetch_share(pf, pf_lines, pf_step, p);
    __m512 wv[NB][2];
    for (int j = 0; j < NB; ++j) widen_pair(w + j * stride + 32 * p, wv[j][0], wv[j][1]);
    for (int m = 0; m < MB; ++m) {
      int64_t pair;
      std::memcpy(&pair, x + m * K + 2 * p, sizeof(pair));
      const __m512 xv = _mm512_castsi512_ps(_mm512_set1_epi64(pair));
      for (int j = 0; j < NB; ++j) {
        acc[m][j][0] = _mm512_fmadd_ps(xv, wv[j][0], acc[m][j][0]);
        acc[m][j][1] = _mm512_fmadd_ps(xv, wv[j][1], acc[m][j][1]);
      }
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int j = 0; j < NB; ++j) {
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + j * stride + 16 * K));
    for (int m = 0; m < MB; ++m) {
      const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(acc[m][j][0], even, acc[m][j][1]),
                                       _mm512_permutex2var_ps(acc[m][j][0], odd, acc[m][j][1]));
      _mm512_storeu_ps(c + m * 64 + 16 * j, _mm512_mul_ps(sum, scale));
    }
  }
}
#endif

#if LLM_HAVE_AVX2_FMA
// k pairs summed exactly in int32 before each run's sum is added in fp32: 256 * 2 * 127 * 32767 < 2^31.
constexpr int64_t I16_RUN_PAIRS = 256;

// Rows x [M, K] fp32 rounded to int16 per row for vpmaddwd: x[m][k] ~ scales[m] * q[m][k], scales[m] =
// max_k |x[m][k]| / 32767 (1 for an all-zero row), q rounded to nearest (|q| <= 32767).
inline void quantize_rows_i16(const float* x, int64_t M, int64_t K, int16_t* q, float* scales) {
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
      scales[m] = amax > 0.f ? amax / 32767.f : 1.f;
      const float inv = amax > 0.f ? 32767.f / amax : 0.f;
      for (int64_t k = 0; k < K; ++k)
        q[m * K + k] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(row[k] * inv))));
    }
  });
}

// int16 rows q[0..MB) (K apart) against NB consecutive int8 blocks: c[m * 64 + 16 * j + n] = sum_k q[m][k] q_j[n][k]
// (unscaled), exact in int32 within each run of I16_RUN_PAIRS k pairs, the runs added in fp32 in k order (so a
// row's sum is the same whatever MB and NB). A k pair's 8 outputs (16 bytes: each output's even and odd k side by
// side) widen to int16 (vpmovsxbw) and vpmaddwd with the row's broadcast pair gives their 8 two-k sums: 4 uops per
// 16 weights and row, where widening to fp32 for FMAs took 2 per 8 weights before any product.
template <int MB, int NB>
inline void int8_block_i16_avx2(const int16_t* q, int64_t K, const int8_t* w, int64_t stride, float* c,
                                const char* pf = nullptr, int64_t pf_lines = 0) {
  const int64_t pairs = K / 2;
  const int64_t pf_step = pf ? (pf_lines + pairs - 1) / pairs : 0;
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) std::fill(c + m * 64 + 16 * j, c + m * 64 + 16 * j + 16, 0.f);
  for (int64_t p0 = 0; p0 < pairs; p0 += I16_RUN_PAIRS) {
    const int64_t p1 = std::min(pairs, p0 + I16_RUN_PAIRS);
    __m256i acc[MB][NB][2];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_si256();
    for (int64_t p = p0; p < p1; ++p) {
      prefetch_share(pf, pf_lines, pf_step, p);
      __m256i xv[MB];
      for (int m = 0; m < MB; ++m) {
        int32_t pair;
        std::memcpy(&pair, q + m * K + 2 * p, sizeof(pair));
        xv[m] = _mm256_set1_epi32(pair);
      }
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < 2; ++h) {
          const __m256i wv = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * stride + 32 * p + 16 * h)));
          for (int m = 0; m < MB; ++m) acc[m][j][h] = _mm256_add_epi32(acc[m][j][h], _mm256_madd_epi16(wv, xv[m]));
        }
    }
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j)
        for (int h = 0; h < 2; ++h) {
          float* cj = c + m * 64 + 16 * j + 8 * h;
          _mm256_storeu_ps(cj, _mm256_add_ps(_mm256_loadu_ps(cj), _mm256_cvtepi32_ps(acc[m][j][h])));
        }
  }
}

// Rows q[0..rows) (rows <= 6, int16 with per-row `scales`) against `nbs` (<= 4) int8 blocks into c: c[m * 64 + 16 * j
// + n] = scales[m] * scale_j[n] * sum_k q[m][k] q_j[n][k]. One row takes all the blocks at once, two rows two.
inline void int8_rows_i16_avx2(const int16_t* q, const float* scales, int64_t rows, int64_t K, const int8_t* w,
                               int64_t stride, int64_t nbs, float* c, const char* pf, int64_t pf_lines) {
  for (int64_t m = 0; m < rows; m += 2) {
    const int16_t* qm = q + m * K;
    float* cm = c + m * 64;
    if (rows - m == 1) {
      switch (nbs) {
        case 4: int8_block_i16_avx2<1, 4>(qm, K, w, stride, cm, pf, pf_lines); break;
        case 3: int8_block_i16_avx2<1, 3>(qm, K, w, stride, cm, pf, pf_lines); break;
        case 2: int8_block_i16_avx2<1, 2>(qm, K, w, stride, cm, pf, pf_lines); break;
        default: int8_block_i16_avx2<1, 1>(qm, K, w, stride, cm, pf, pf_lines);
      }
    } else {
      int64_t j = 0;
      for (; j + 2 <= nbs; j += 2)
        int8_block_i16_avx2<2, 2>(qm, K, w + j * stride, stride, cm + 16 * j, j == 0 ? pf : nullptr, pf_lines);
      if (j < nbs) int8_block_i16_avx2<2, 1>(qm, K, w + j * stride, stride, cm + 16 * j, j == 0 ? pf : nullptr, pf_lines);
    }
    pf = nullptr;
  }
  for (int64_t j = 0; j < nbs; ++j) {
    const float* scale = reinterpret_cast<const float*>(w + j * stride + 16 * K);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t n = 0; n < 16; ++n) c[m * 64 + 16 * j + n] *= scales[m] * scale[n];
  }
}
#endif

#if LLM_HAVE_AVX512_BF16
// bf16 rows: as int8_block_fp32, but each k pair's weights are rounded to bf16 (exact: |q| <= 127 needs 7 bits) and
// multiplied with vdpbf16ps (16 outputs x 2 k per instruction, small_gemm's bf16 layout), twice the multiply-adds
// per instruction of fp32; the products are exact and summed in fp32.
template <int MB, int NB>
inline void int8_block_bf16(const bf16* x, int64_t K, const int8_t* w, int64_t stride, float* c,
                            const char* pf = nullptr, int64_t pf_lines = 0) {
  const int64_t pf_step = pf ? (pf_lines + K / 2 - 1) / (K / 2) : 0;
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    prefetch_share(pf, pf_lines, pf_step, p);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      __m512 lo, hi;
      widen_pair(w + j * stride + 32 * p, lo, hi);
      wv[j] = _mm512_cvtne2ps_pbh(hi, lo);
    }
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + j * stride + 16 * K));
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(c + m * 64 + 16 * j, _mm512_mul_ps(acc[m][j], scale));
  }
}

// A run of `pairs` k pairs of NB blocks, already widened to bf16 (wb[j * pairs + p]), for rows x[0..MB) (rows K
// apart, x at the run's first k): c[m * 64 + 16 * j + n] (fp32 sums, unscaled) += the run's products; `first`: start
// from zero. Storing and reloading the fp32 sums between runs is exact, so the sums equal int8_block_bf16's.
template <int MB, int NB>
inline void staged_block_bf16(const bf16* x, int64_t K, const __m512bh* wb, int64_t pairs, float* c, bool first) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + m * 64 + 16 * j);
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = wb[j * pairs + p];
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(c + m * 64 + 16 * j, acc[m][j]);
}
#endif

#if LLM_HAVE_AVX512_BF16
// All M rows of bf16 x against a group of nbs (<= 4) blocks at w (blocks `stride` bytes apart): sums[m * 64 + 16 * j
// + n] = scale_j[n] * sum_k x[m][k] q_j[n][k], bit-identical to int8_block_bf16's. Each run of STAGED_PAIRS k pairs
// is widened to bf16 once into `staged`, then every pass of 6 rows reads it from there.
inline void staged_group(const torch::Tensor& x, int64_t K, const int8_t* w, int64_t stride, int64_t nbs,
                         std::vector<__m512bh>& staged, float* sums) {
  const int64_t M = x.size(0);
  const bf16* xs = reinterpret_cast<const bf16*>(x.data_ptr());
  for (int64_t p0 = 0; p0 < K / 2; p0 += STAGED_PAIRS) {
    const int64_t pairs = std::min(STAGED_PAIRS, K / 2 - p0);
    for (int64_t j = 0; j < nbs; ++j)
      for (int64_t p = 0; p < pairs; ++p) {
        __m512 lo, hi;
        widen_pair(w + j * stride + 32 * (p0 + p), lo, hi);
        staged[j * pairs + p] = _mm512_cvtne2ps_pbh(hi, lo);
      }
    for (int64_t m0 = 0; m0 < M; m0 += 6) {
      with_constant<6>(std::min<int64_t>(6, M - m0), [&](auto mb) {
        constexpr int MB = decltype(mb)::value;
        const bf16* xr = xs + m0 * K + 2 * p0;
        float* c = sums + m0 * 64;
        if (nbs == 4) staged_block_bf16<MB, 4>(xr, K, staged.data(), pairs, c, p0 == 0);
        else for (int64_t j = 0; j < nbs; ++j)
          staged_block_bf16<MB, 1>(xr, K, staged.data() + j * pairs, pairs, c + 16 * j, p0 == 0);
      });
    }
  }
  for (int64_t j = 0; j < nbs; ++j) {
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + j * stride + 16 * K));
    for (int64_t m = 0; m < M; ++m)
      _mm512_storeu_ps(sums + m * 64 + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(sums + m * 64 + 16 * j), scale));
  }
}
#endif

#if LLM_HAVE_AVX512_VNNI
// Rows x [M, K] (fp32 or bf16; K % W8A8_GROUP == 0) rounded to int8 per group of W8A8_GROUP k: q[m][k] =
// round(x[m][k] * (127 / a)) (ties to even, |q| <= 127), scales[m][g] = a / 127 (1 for an all-zero group), a = max |x|
// over the group (NaN where the group holds a NaN, so that the results are NaN as x's float product would be; where
// it holds infinities of one sign, q is +-127 there and 0 elsewhere, the scale inf: the results are +-inf, or NaN for
// a weight of 0, as x's are; infinities of both signs make the scale NaN);
// scales [M, K / W8A8_GROUP]. starts[m][g] = -128 * sum_{k in g} q[m][k]: the group's sum in w8a8_block starts there,
// which takes off what the weights' offset of 128 adds (only the vector kernel's: starts is null for the AMX tiles,
// whose tdpbssd multiplies signed bytes).
template <typename T>
inline void quantize_groups_s8(const T* x, int64_t M, int64_t K, int8_t* q, float* scales, int32_t* starts) {
  at::parallel_for(0, M * K / W8A8_GROUP, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {  // group i: row i / (K / W8A8_GROUP), at x + i * W8A8_GROUP
      const T* v = x + i * W8A8_GROUP;
      float amax = 0.f;
      bool nan = false, pos_inf = false, neg_inf = false;
      for (int64_t k = 0; k < W8A8_GROUP; ++k) {
        const float value = to_float(v[k]), a = std::fabs(value);
        amax = std::max(amax, a);
        nan |= a != a;
        pos_inf |= value == std::numeric_limits<float>::infinity();
        neg_inf |= value == -std::numeric_limits<float>::infinity();
      }
      nan |= pos_inf && neg_inf;  // inf - inf: the group's sum cannot tell which weights met which sign
      scales[i] = nan ? std::numeric_limits<float>::quiet_NaN() : amax > 0.f ? amax / 127.f : 1.f;
      float inv = amax > 0.f ? 127.f / amax : 0.f;
      // A group below about 3.7e-37 (127 / amax past fp32's range): both scaled by 2^64 first, exactly.
      const float pre = std::isinf(inv) ? 0x1p64f : 1.f;
      if (pre != 1.f) inv = 127.f / (amax * pre);
      const bool infinite = std::isinf(amax);  // +-127 where x is +-inf (the scale is inf), 0 elsewhere
      int32_t sum = 0;
      for (int64_t k = 0; k < W8A8_GROUP; ++k) {
        const float value = to_float(v[k]);
        const int32_t r = infinite ? (std::isinf(value) ? (value > 0.f ? 127 : -127) : 0)
            : static_cast<int32_t>(std::max(-127.f, std::min(127.f, std::nearbyint(value * pre * inv))));
        q[i * W8A8_GROUP + k] = static_cast<int8_t>(r);
        sum += r;
      }
      if (starts != nullptr) starts[i] = -128 * sum;
    }
  });
}

// c[m * 64 + 16 * j + n] *= scale_j[n] for m < rows, j < nbs: the sums of W8A8's groups times the weights' scales
// (the 16 fp32 after block j's K * 16 bytes).
inline void scale_by_weights(const int8_t* w, int64_t stride, int64_t K, int64_t nbs, int64_t rows, float* c) {
  for (int64_t j = 0; j < nbs; ++j) {
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + j * stride + 16 * K));
    for (int64_t m = 0; m < rows; ++m) {
      float* cj = c + m * 64 + 16 * j;
      _mm512_store_ps(cj, _mm512_mul_ps(_mm512_load_ps(cj), scale));
    }
  }
}

// Word i of a k quad's 64 bytes (k pair 2p's 32, then 2p + 1's) that word i of the interleaved vector takes, so that
// 32-bit lane n holds output n's 4 consecutive k, as vpdpbusd multiplies them.
alignas(64) constexpr int16_t QUAD_WORDS[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// int8 rows q[0..MB) (K apart; group scales xs and starting sums starts, K / W8A8_GROUP per row, from
// quantize_groups_s8) against NB consecutive int8 blocks: c[m * 64 + 16 * j + n] = scale_j[n] * sum_g xs[m][g] *
// (starts[m][g] + sum_{k in g} q[m][k] (q_j[n][k] + 128)) = scale_j[n] * sum_g xs[m][g] * sum_{k in g} q[m][k]
// q_j[n][k]. A group's sum is exact in int32 (|partial sums| <= 127 * 255 * 64 + 128 * 127 * 64) and in its fp32
// conversion (< 2^24); the groups are added in fp32 in k order (in c, so a row's result is the same whatever MB and
// NB).
template <int MB, int NB>
inline void w8a8_block(const int8_t* q, const float* xs, const int32_t* starts, int64_t K, const int8_t* w,
                       int64_t stride, float* c, const char* pf = nullptr, int64_t pf_lines = 0) {
  const int64_t quads = K / 4, groups = K / W8A8_GROUP;
  const int64_t pf_step = pf ? (pf_lines + quads - 1) / quads : 0;
  const __m512i interleave = _mm512_load_si512(QUAD_WORDS);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));  // flipped: int8 q -> unsigned q + 128
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) _mm512_store_ps(c + m * 64 + 16 * j, _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sums[MB][NB];
    for (int m = 0; m < MB; ++m) {
      const __m512i start = _mm512_set1_epi32(starts[m * groups + g]);
      for (int j = 0; j < NB; ++j) sums[m][j] = start;
    }
    for (int64_t p = g * (W8A8_GROUP / 4); p < (g + 1) * (W8A8_GROUP / 4); ++p) {
      prefetch_share(pf, pf_lines, pf_step, p);
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j)
        wv[j] = _mm512_xor_si512(
            _mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(w + j * stride + 64 * p)), sign);
      for (int m = 0; m < MB; ++m) {
        int32_t quad;
        std::memcpy(&quad, q + m * K + 4 * p, sizeof(quad));
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int j = 0; j < NB; ++j) sums[m][j] = _mm512_dpbusd_epi32(sums[m][j], wv[j], xv);
      }
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 scale = _mm512_set1_ps(xs[m * groups + g]);
      for (int j = 0; j < NB; ++j) {
        float* cj = c + m * 64 + 16 * j;
        _mm512_store_ps(cj, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m][j]), scale, _mm512_load_ps(cj)));
      }
    }
  }
  scale_by_weights(w, stride, K, NB, MB, c);
}
#endif

#if LLM_HAVE_AMX_INT8 && LLM_HAVE_AVX512_VNNI
// W8A8 calls of at least this many rows run on AMX-INT8 tiles: below it the vector kernel's time is the weights'
// stream, which tiles do not shorten, and rearranging the weights for them adds to it (on the 1.7B shape's layer
// GEMMs, 2 threads of a Xeon with AMX: tiles 1.35x the vector kernel's time at 1 row, 1.03x at 8, 0.86x at 12,
// 0.66x at 32, 0.44x at 256).
constexpr int64_t W8A8_AMX_MIN_ROWS = 12;
constexpr int64_t W8A8_AMX_ROWS = 32;  // rows per pass: two A tiles of 16 rows

// nbs (<= 4) consecutive blocks (block j at w + j * stride, K / 4 quads of 64 bytes as int8_gemm_pack lays them)
// rearranged into tdpbssd's B tiles at b: block j's quad p at b + j * 16 K + 64 p with 32-bit lane n holding output
// n's 4 consecutive k (QUAD_WORDS), so one group of W8A8_GROUP k of a block is one 16 x 64-byte tile (1 KiB).
inline void amx_b_tiles(const int8_t* w, int64_t K, int64_t stride, int64_t nbs, int8_t* b) {
  const __m512i interleave = _mm512_load_si512(QUAD_WORDS);
  for (int64_t j = 0; j < nbs; ++j)
    for (int64_t p = 0; p < K / 4; ++p)
      _mm512_store_si512(b + j * 16 * K + 64 * p,
                         _mm512_permutexvar_epi16(interleave, _mm512_loadu_si512(w + j * stride + 64 * p)));
}

// Up to W8A8_AMX_ROWS int8 rows q (K apart; the A tiles read 32 rows, so rows past `rows` must be readable; group
// scales xs, K / W8A8_GROUP per row) against nbs blocks of B tiles at b (amx_b_tiles): c[m * 64 + 16 * j + n] =
// sum_g xs[m][g] * sum_{k in g} q[m][k] q_j[n][k], m < rows, before the weights' scales. A group's sums are tdpbssd's
// (signed bytes on both sides: no offset to take off), exact in int32 as w8a8_block's are, and go through the same
// fp32 conversion and multiply-add in the same group order: the same bits as w8a8_block, whatever the rows.
// Tiles: C 0-3 (2 row tiles x 2 blocks), A 4-5, B 6-7; the caller has loaded a configuration of 16 x 64-byte tiles.
inline void w8a8_pass_amx(const int8_t* q, const float* xs, int64_t K, const int8_t* b, int64_t nbs, int64_t rows,
                          float* c) {
  const int64_t groups = K / W8A8_GROUP;
  alignas(64) int32_t sums[4][16 * 16];  // C tile 2 i + j: row tile i, block j0 + j
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < nbs; ++j) _mm512_store_ps(c + m * 64 + 16 * j, _mm512_setzero_ps());
  const bool two_row_tiles = rows > 16;
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(4, q + g * W8A8_GROUP, K);
    if (two_row_tiles) _tile_loadd(5, q + 16 * K + g * W8A8_GROUP, K);
    for (int64_t j0 = 0; j0 < nbs; j0 += 2) {
      const bool two_blocks = j0 + 1 < nbs;
      _tile_loadd(6, b + j0 * 16 * K + g * 1024, 64);
      _tile_zero(0);
      _tile_dpbssd(0, 4, 6);
      if (two_row_tiles) { _tile_zero(2); _tile_dpbssd(2, 5, 6); }
      if (two_blocks) {
        _tile_loadd(7, b + (j0 + 1) * 16 * K + g * 1024, 64);
        _tile_zero(1);
        _tile_dpbssd(1, 4, 7);
        if (two_row_tiles) { _tile_zero(3); _tile_dpbssd(3, 5, 7); }
      }
      _tile_stored(0, sums[0], 64);
      if (two_blocks) _tile_stored(1, sums[1], 64);
      if (two_row_tiles) {
        _tile_stored(2, sums[2], 64);
        if (two_blocks) _tile_stored(3, sums[3], 64);
      }
      for (int64_t m = 0; m < rows; ++m) {
        const __m512 scale = _mm512_set1_ps(xs[m * groups + g]);
        const int32_t* tile_row = sums[2 * (m / 16)] + 16 * (m % 16);
        for (int64_t j = 0; j < (two_blocks ? 2 : 1); ++j) {
          float* cj = c + m * 64 + 16 * (j0 + j);
          const __m512i s = _mm512_load_si512(tile_row + 256 * j);
          _mm512_store_ps(cj, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, _mm512_load_ps(cj)));
        }
      }
    }
  }
}
#endif

}  // namespace
}  // namespace llm_cpu

// Whether this build runs int8_gemm with int8 activations (W8A8): AVX512-VNNI.
bool w8a8_gemm_available() { return LLM_HAVE_AVX512_VNNI; }

// The k per activation scale of int8_gemm with int8 activations: K must be a multiple of it.
int64_t w8a8_group_size() { return llm_cpu::W8A8_GROUP; }

// Whether this build runs int8_gemm: AVX-512 or AVX2 with FMA for fp32 activations; bf16 activations need
// AVX512-BF16, or AVX2 with FMA (through the fp32 path).
bool int8_gemm_available(bool bf16) {
  return bf16 ? LLM_HAVE_AVX512_BF16 || LLM_HAVE_AVX2_FMA : LLM_HAVE_AVX512 || LLM_HAVE_AVX2_FMA;
}

// The most rows one int8_gemm call takes.
int64_t int8_gemm_max_rows() { return llm_cpu::INT8_GEMM_MAX_ROWS; }

// weight [N, K] fp32 or bf16, N % 16 == 0, K even -> int8 [N / 16, 16 * K + 64]: per block of 16 outputs, for each
// pair of consecutive k the 16 outputs' two int8 values q = round(w / scale) (|q| <= 127, ties away from zero),
// output-major (small_gemm's bf16 tile layout, one byte per weight), then the 16 fp32 scales
// max_k |w[n][k]| / 127 (1 for an all-zero row) as raw bytes. Returns the packed tensor.
torch::Tensor int8_gemm_pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16)
              && weight.size(0) % 16 == 0 && weight.size(1) >= 2 && weight.size(1) % 2 == 0,
              "int8_gemm_pack: fp32 or bf16 [N, K], N % 16 == 0, K even");
  const int64_t N = weight.size(0), K = weight.size(1), NB = N / 16, stride = 16 * K + llm_cpu::INT8_SCALE_BYTES;
  torch::Tensor w = weight.to(at::kFloat).contiguous();
  torch::Tensor packed = llm_cpu::empty_on_huge_pages({NB, stride}, weight.options().dtype(at::kChar));
  const float* ws = w.data_ptr<float>();
  int8_t* ps = packed.data_ptr<int8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      int8_t* block = ps + nb * stride;
      float scales[16];
      for (int64_t n = 0; n < 16; ++n) {
        const float* row = ws + (nb * 16 + n) * K;
        float amax = 0.f;
        for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
        scales[n] = amax > 0.f ? amax / 127.f : 1.f;
        for (int64_t k = 0; k < K; ++k) {
          const float q = std::round(row[k] / scales[n]);
          block[32 * (k / 2) + 2 * n + k % 2] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
        }
      }
      std::memcpy(block + 16 * K, scales, sizeof(scales));
    }
  });
  return packed;
}

// The weight int8_gemm_pack stored, dequantized into `out` [N, K] (fp32 or bf16, rounded once): scale[n] * q[n][k].
// The reference int8_gemm computes against, and the weights of prompt-sized GEMMs (dequantized per call, then a
// oneDNN GEMM).
void int8_gemm_unpack(torch::Tensor out, torch::Tensor packed) {
  const int64_t K = out.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous()
              && packed.size(1) == 16 * K + llm_cpu::INT8_SCALE_BYTES, "int8_gemm_unpack: packed [N / 16, 16 K + 64]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == packed.size(0) * 16
              && (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "int8_gemm_unpack: out fp32 or bf16 [N, K] contiguous");
  const int64_t NB = packed.size(0), stride = packed.size(1);
  const int8_t* ps = packed.data_ptr<int8_t>();
  llm_cpu::dispatch_float_types(out.scalar_type(), "int8_gemm_unpack", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* ws = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nb = begin; nb < end; ++nb) {
        const int8_t* block = ps + nb * stride;
        float scales[16];
        std::memcpy(scales, block + 16 * K, sizeof(scales));
        for (int64_t n = 0; n < 16; ++n)
          for (int64_t k = 0; k < K; ++k)
            ws[(nb * 16 + n) * K + k] =
                llm_cpu::from_float<T>(scales[n] * static_cast<float>(block[32 * (k / 2) + 2 * n + k % 2]));
      }
    });
  });
}

// out [M, N] = x [M, K] * dequant(packed)^T (+ bias [N], added in fp32), x fp32 or bf16 (bias the same; out
// the same, or fp32 for bf16 x: the sums unrounded), 1 <= M <= int8_gemm_max_rows; packed from int8_gemm_pack.
// Threads take groups of 4 blocks of 16 outputs as they go (as small_gemm_vector does); each group's weights stream
// from memory once and the rows pass over them 6 at a time (12 for bf16, 8 for W8A8). int8_activations (W8A8,
// w8a8_gemm_available, K % w8a8_group_size() == 0): x is rounded to int8 per row and group of k first
// (quantize_groups_s8) and multiplied with vpdpbusd.
void int8_gemm(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
               bool int8_activations) {
  using namespace llm_cpu;
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(int8_gemm_available(bf16_x), "int8_gemm: this build has no ",
              bf16_x ? "AVX512-BF16 and no AVX2 with FMA" : "AVX-512 and no AVX2 with FMA");
  TORCH_CHECK(!int8_activations || w8a8_gemm_available(), "int8_gemm: int8 activations need AVX512-VNNI");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (bf16_x || x.scalar_type() == at::kFloat) && x.size(0) >= 1
              && x.size(0) <= INT8_GEMM_MAX_ROWS, "int8_gemm: x fp32 or bf16 [M <= ", INT8_GEMM_MAX_ROWS,
              ", K] contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous()
              && packed.size(1) == 16 * K + INT8_SCALE_BYTES, "int8_gemm: packed int8 [N / 16, 16 K + 64] for K = ", K);
  TORCH_CHECK(!int8_activations || K % W8A8_GROUP == 0, "int8_gemm: int8 activations need K % ", W8A8_GROUP,
              " == 0, got K = ", K);
  const int64_t NB = packed.size(0), N = NB * 16, stride = packed.size(1);
  const bool fp32_out = out.scalar_type() == at::kFloat;  // for bf16 x: the fp32 sums unrounded
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N
              && (fp32_out || out.scalar_type() == x.scalar_type()),
              "int8_gemm: out [M, N] contiguous, x's dtype or fp32");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type()),
              "int8_gemm: bias [N] of x's dtype");
#if LLM_HAVE_AVX2_FMA
  if (bf16_x) {
    // AVX2 has no bf16 arithmetic: the rows widened to fp32 (exact) through the fp32 path, the bias added in fp32
    // and the sums rounded to bf16 once, as the AVX512-BF16 path rounds them.
    torch::Tensor wide = torch::empty(out.sizes(), out.options().dtype(at::kFloat));
    int8_gemm(wide, x.to(at::kFloat), packed, c10::nullopt, false);
    if (bias) wide.add_(bias->to(at::kFloat));
    out.copy_(wide);
    return;
  }
#endif
#if LLM_HAVE_AVX512 || LLM_HAVE_AVX2_FMA
  const int8_t* ws = packed.data_ptr<int8_t>();
  const int64_t groups = (NB + 3) / 4;
#if LLM_HAVE_AVX2_FMA
  // fp32 rows rounded to int16 once per call, for vpmaddwd (int8_block_i16_avx2).
  std::vector<int16_t> xq(M * K);
  std::vector<float> x_scales(M);
  quantize_rows_i16(x.data_ptr<float>(), M, K, xq.data(), x_scales.data());
#endif
#if LLM_HAVE_AMX_INT8 && LLM_HAVE_AVX512_VNNI
  const bool amx = int8_activations && M >= W8A8_AMX_MIN_ROWS && amx_usable();
  // The A tiles read whole 16-row tiles: the rows past M are zeros.
  const int64_t padded_rows = amx ? (M + W8A8_AMX_ROWS - 1) / W8A8_AMX_ROWS * W8A8_AMX_ROWS : M;
#else
  constexpr bool amx = false;
  const int64_t padded_rows = M;
#endif
#if LLM_HAVE_AVX512_VNNI
  // W8A8: the rows rounded to int8 once per call, a scale per group of W8A8_GROUP k.
  std::vector<int8_t> xq8(int8_activations ? padded_rows * K : 0);
  std::vector<float> x_group_scales(int8_activations ? M * K / W8A8_GROUP : 0);
  std::vector<int32_t> x_group_starts(int8_activations && !amx ? M * K / W8A8_GROUP : 0);
  int32_t* group_starts = amx ? nullptr : x_group_starts.data();
  if (int8_activations) {
    if (bf16_x) quantize_groups_s8(reinterpret_cast<const bf16*>(x.data_ptr()), M, K, xq8.data(), x_group_scales.data(),
                                   group_starts);
    else quantize_groups_s8(x.data_ptr<float>(), M, K, xq8.data(), x_group_scales.data(), group_starts);
  }
#endif
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), groups)))
  {
    alignas(64) float c[32 * 64];
#if LLM_HAVE_AMX_INT8 && LLM_HAVE_AVX512_VNNI
    std::vector<int8_t> b_tiles;  // the group's weights as B tiles (amx_b_tiles), 64-byte aligned
    int8_t* b = nullptr;
    if (amx) {
      b_tiles.resize(4 * 16 * K + 64);
      b = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(b_tiles.data()) + 63) & ~uintptr_t{63});
      TileConfig config;
      for (int t = 0; t < 8; ++t) { config.rows[t] = 16; config.colsb[t] = 64; }
      _tile_loadconfig(&config);
    }
#endif
#if LLM_HAVE_AVX512_BF16
    std::vector<__m512bh> staged;  // the group's widened weights, STAGED_PAIRS k pairs of each block
    std::vector<__m512> sums;  // every row's scaled sums for the group, [M][64] fp32 (64-byte aligned rows)
    if (bf16_x && !int8_activations && M >= STAGED_MIN_ROWS) {
      staged.resize(4 * std::min(STAGED_PAIRS, K / 2));
      sums.resize(M * 4);
    }
#endif
    // Rows per pass over a group: 32 on AMX tiles, 8 for W8A8 on vectors (2 blocks at a time), 12 for bf16 (2
    // blocks), 6 for fp32 (4 blocks; 2 x 2 accumulators).
    const int64_t step = amx ? W8A8_AMX_ROWS : int8_activations ? 8 : bf16_x ? 12 : 6;
    for (int64_t g = taken.fetch_add(1); g < groups; g = taken.fetch_add(1)) {
      const int64_t nb0 = 4 * g, nbs = std::min<int64_t>(4, NB - nb0);
      const int8_t* w = ws + nb0 * stride;
      // The next group this thread likely takes, prefetched a share per pass of 6 rows (see small_gemm_vector).
      const int64_t next = g + omp_get_num_threads(), passes = (M + step - 1) / step;
      const int64_t pf_total = passes >= 2 && next < groups ? std::min<int64_t>(4, NB - 4 * next) * stride / 64 : 0;
      const char* pf_base = reinterpret_cast<const char*>(ws + 4 * next * stride);
      for (int64_t m0 = 0; m0 < M; m0 += step) {
        const int64_t rows = std::min<int64_t>(step, M - m0), pass = m0 / step;
        const char* pf = pf_total ? pf_base + 64 * (pass * pf_total / passes) : nullptr;
        const int64_t pf_lines = pf_total ? (pass + 1) * pf_total / passes - pass * pf_total / passes : 0;
        const float* sum = c;  // the pass's rows' scaled sums, 64 apart
        if (amx) {
#if LLM_HAVE_AMX_INT8 && LLM_HAVE_AVX512_VNNI
          if (m0 == 0) amx_b_tiles(w, K, stride, nbs, b);
          w8a8_pass_amx(xq8.data() + m0 * K, x_group_scales.data() + m0 * (K / W8A8_GROUP), K, b, nbs, rows, c);
          scale_by_weights(w, stride, K, nbs, rows, c);
#endif
        } else if (int8_activations) {
#if LLM_HAVE_AVX512_VNNI
          const int8_t* xr = xq8.data() + m0 * K;
          const float* sr = x_group_scales.data() + m0 * (K / W8A8_GROUP);
          const int32_t* starts = x_group_starts.data() + m0 * (K / W8A8_GROUP);
          with_constant<8>(rows, [&](auto mb) {
            constexpr int MB = decltype(mb)::value;
            for (int64_t j = 0; j < nbs; j += 2) {
              if (j + 1 < nbs) w8a8_block<MB, 2>(xr, sr, starts, K, w + j * stride, stride, c + 16 * j,
                                                 j ? nullptr : pf, j ? 0 : pf_lines);
              else w8a8_block<MB, 1>(xr, sr, starts, K, w + j * stride, stride, c + 16 * j);
            }
          });
#endif
        } else if (bf16_x) {
#if LLM_HAVE_AVX512_BF16
          if (M >= STAGED_MIN_ROWS) {
            if (m0 == 0) staged_group(x, K, w, stride, nbs, staged, reinterpret_cast<float*>(sums.data()));
            sum = reinterpret_cast<const float*>(sums.data()) + m0 * 64;
          } else {
            const bf16* xs = reinterpret_cast<const bf16*>(x.data_ptr()) + m0 * K;
            if (rows == 12) {  // 12 rows x 2 blocks: each widened weight vector serves 12 rows
              for (int64_t j = 0; j < nbs; j += 2) {
                if (j + 1 < nbs) int8_block_bf16<12, 2>(xs, K, w + j * stride, stride, c + 16 * j,
                                                        j ? nullptr : pf, j ? 0 : pf_lines);
                else int8_block_bf16<12, 1>(xs, K, w + j * stride, stride, c + 16 * j);
              }
            } else {
              for (int64_t r0 = 0; r0 < rows; r0 += 6)
                with_constant<6>(std::min<int64_t>(6, rows - r0), [&](auto mb) {
                  constexpr int MB = decltype(mb)::value;
                  const bf16* xr = xs + r0 * K;
                  float* cr = c + r0 * 64;
                  if (nbs == 4) int8_block_bf16<MB, 4>(xr, K, w, stride, cr, r0 ? nullptr : pf, r0 ? 0 : pf_lines);
                  else for (int64_t j = 0; j < nbs; ++j) int8_block_bf16<MB, 1>(xr, K, w + j * stride, stride, cr + 16 * j);
                });
            }
          }
#endif
        } else {
          // Two blocks at a time: 2 accumulators per row and block (even and odd k) fill the registers.
#if LLM_HAVE_AVX2_FMA
          int8_rows_i16_avx2(xq.data() + m0 * K, x_scales.data() + m0, rows, K, w, stride, nbs, c, pf, pf_lines);
#else
          const float* xs = x.data_ptr<float>() + m0 * K;
          with_constant<6>(rows, [&](auto mb) {
            constexpr int MB = decltype(mb)::value;
            for (int64_t j = 0; j < nbs; j += 2) {
              if (j + 1 < nbs) int8_block_fp32<MB, 2>(xs, K, w + j * stride, stride, c + 16 * j,
                                                      j ? nullptr : pf, j ? 0 : pf_lines);
              else int8_block_fp32<MB, 1>(xs, K, w + j * stride, stride, c + 16 * j);
            }
          });
#endif
        }
        // The pass's rows of out: the sums plus the bias in fp32, rounded to bf16 once.
        if (bf16_x) {
#if LLM_HAVE_AVX512_BF16
          const bf16* bs = bias ? reinterpret_cast<const bf16*>(bias->data_ptr()) : nullptr;
          auto store = [&](auto* ys) {
            for (int64_t m = 0; m < rows; ++m)
              for (int64_t j = 0; j < nbs; ++j)
                store_row16(ys + (m0 + m) * N + (nb0 + j) * 16, sum + m * 64 + 16 * j, bs ? bs + (nb0 + j) * 16 : nullptr);
          };
          if (fp32_out) store(out.data_ptr<float>());
          else store(reinterpret_cast<bf16*>(out.data_ptr()));
#endif
        } else {
          float* ys = out.data_ptr<float>();
          const float* bs = bias ? bias->data_ptr<float>() : nullptr;
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t n = 0; n < 16 * nbs; ++n)
              ys[(m0 + m) * N + nb0 * 16 + n] = sum[m * 64 + n] + (bs ? bs[nb0 * 16 + n] : 0.f);
        }
      }
    }
#if LLM_HAVE_AMX_INT8 && LLM_HAVE_AVX512_VNNI
    if (amx) _tile_release();
#endif
  }
#endif
}
