// GEMMs of decode steps (at most 64 rows on AMX tiles, up to 256 on vector units, any number for fp32 on AVX2:
// small_gemm_max_rows), streaming the weights from a layout packed for the tiles.
// A decode step's GEMMs read every weight once and do little arithmetic per byte: they are bound by how fast the
// weights stream from memory. Here each thread walks its own contiguous run of 1 KiB weight tiles, which the
// hardware prefetchers follow (oneDNN's prepacked path, used for larger batches and prompts, blocks for
// arithmetic rather than for one pass over the weights). Intel AMX: tdpbf16ps multiplies a 16 x 32 bf16 tile of rows by a 32 x 16 tile of weights
// (stored as 16 rows of 16 pairs of consecutive k) into 16 x 16 fp32. fp32 weights take AVX-512 multiply-adds
// instead (4 blocks of 16 outputs by up to 6 rows in registers, each weight vector used by every row, so each
// weight is read from memory once per 6 rows). bf16 weights on CPUs without AMX (AMD
// Zen 4) take the same register blocking with AVX512-BF16's vdpbf16ps on the tile layout (one vector: 16 outputs x 2
// consecutive k, the row's pair broadcast). fp32 on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3) takes 8-lane
// multiply-adds on the same layout for every GEMM, prompts included: up to AVX2_STREAM_ROWS rows one or two at a time
// (streaming the weights once), more in 6 x 16 register blocks over panels of rows (small_gemm_avx2_rows), which
// measured 1.07-1.44x oneDNN's fp32 GEMM at 1-256 rows and level at 2048 on a Zen 3 (docs/kernels.md). bf16 there
// (a CPU without AVX-512, where oneDNN has no bf16 GEMM) runs on the same fp32 multiply-adds from the bf16 tile
// layout, the weights widened in registers (weights8): half of fp32's bytes per decode step.
#include "common.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#define LLM_HAVE_AVX512 1
#else
#define LLM_HAVE_AVX512 0
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define LLM_HAVE_AVX2_FMA 1
#else
#define LLM_HAVE_AVX2_FMA 0
#endif
#if defined(__AVX512BF16__)
#define LLM_HAVE_AVX512_BF16 1
#else
#define LLM_HAVE_AVX512_BF16 0
#endif

namespace llm_cpu {
namespace {

constexpr int64_t SMALL_GEMM_MAX_ROWS = 64;    // on AMX tiles
constexpr int64_t VECTOR_GEMM_MAX_ROWS = 256;  // with vector multiply-adds / dot products (small_gemm_vector)
// fp32 on AVX-512 over more than one pass of 6 rows, K past VECTOR_CHUNK_MIN_K, up to PANEL_MIN_ROWS rows (decode
// steps): K in chunks of VECTOR_K_CHUNK k (small_gemm_fp32_chunked; 16 KiB of a group's weights, which stay in L1
// over the step's few passes). Past PANEL_MIN_ROWS rows (prompt slices), at any K: blocks of PANEL_GROUPS groups
// of 64 outputs, K in chunks of PANEL_K_CHUNK (small_gemm_fp32_panels; 128 KiB of weights, in L2).
constexpr int64_t VECTOR_CHUNK_MIN_K = 1024;
constexpr int64_t VECTOR_K_CHUNK = 64;
constexpr int64_t PANEL_MIN_ROWS = 96;
constexpr int64_t PANEL_GROUPS = 4;
constexpr int64_t PANEL_K_CHUNK = 128;
// On AVX2 (16 registers, 8 lanes; fp32, and bf16 widened to fp32): up to AVX2_STREAM_ROWS rows stream each group of
// weights once, one or two rows at a time; past them, 6-row register blocks (small_gemm_avx2_rows), any number of rows.
constexpr int64_t AVX2_STREAM_ROWS = 4;
constexpr int64_t AVX2_GEMM_MAX_ROWS = std::numeric_limits<int64_t>::max();  // every GEMM
constexpr int64_t AVX2_K_CHUNK = 1024;             // k per chunk of a block: 64 KiB of weights
constexpr int64_t AVX2_PANEL_BYTES = 384 * 1024;   // x per panel and chunk, within a 512 KiB L2 beside the weights
constexpr int64_t AVX2_PANEL_MAX_ROWS = 192;
constexpr int64_t GEMM_RUN_BLOCKS = 6;  // 16-output blocks a thread takes at a time
constexpr int64_t MULTI_BLOCKS = 3;  // blocks per `tile_multi` pass (2 chunks x 3 blocks: 6 C tiles)

#if LLM_HAVE_AMX

// At most 16 rows: C 0 and A 4 configured with the rows there are, B 5 (weights).
inline void tile_block(const bf16* x, int64_t K, const bf16* w, float* c) {
  _tile_zero(0);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    _tile_loadd(5, w + kb * 512, 64);
    _tile_loadd(4, x + kb * 32, K * 2);
    _tile_dpbf16ps(0, 4, 5);
  }
  _tile_stored(0, c, 64);
}

// Tile `t` (a run-time value the unrolled loops below turn into the literal the instruction needs).
inline void tile_zero_n(int t) {
  switch (t) {
    case 0: _tile_zero(0); break; case 1: _tile_zero(1); break; case 2: _tile_zero(2); break;
    case 3: _tile_zero(3); break; case 4: _tile_zero(4); break; default: _tile_zero(5); break;
  }
}
inline void tile_dp_n(int t) {  // C t += A 6 x B 7
  switch (t) {
    case 0: _tile_dpbf16ps(0, 6, 7); break; case 1: _tile_dpbf16ps(1, 6, 7); break;
    case 2: _tile_dpbf16ps(2, 6, 7); break; case 3: _tile_dpbf16ps(3, 6, 7); break;
    case 4: _tile_dpbf16ps(4, 6, 7); break; default: _tile_dpbf16ps(5, 6, 7); break;
  }
}
inline void tile_store_n(int t, float* c) {
  switch (t) {
    case 0: _tile_stored(0, c, 64); break; case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break; case 3: _tile_stored(3, c, 64); break;
    case 4: _tile_stored(4, c, 64); break; default: _tile_stored(5, c, 64); break;
  }
}

// CH (1 or 2) 16-row chunks of x (chunk i at a[i], rows K apart) against NBT consecutive 16-output blocks of
// weights (`step` elements apart) at once: C tile i * NBT + j (<= 6 of them), A 6, B 7. Each chunk's A tile is
// loaded once per 32 k for all NBT blocks (the B tiles after the first chunk's come from L1), not once per block:
// over 16 rows a step's GEMMs load x from L2 three times less often; results bit-identical (each output's sums in one order).
template <int CH, int NBT>
inline void tile_multi(const bf16* const* a, int64_t K, const bf16* w, int64_t step, float* c) {
#pragma GCC unroll 8
  for (int t = 0; t < CH * NBT; ++t) tile_zero_n(t);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
#pragma GCC unroll 4
    for (int i = 0; i < CH; ++i) {
      _tile_loadd(6, a[i] + kb * 32, K * 2);
#pragma GCC unroll 4
      for (int j = 0; j < NBT; ++j) {
        _tile_loadd(7, w + j * step + kb * 512, 64);
        tile_dp_n(i * NBT + j);
      }
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < CH * NBT; ++t) tile_store_n(t, c + 256 * t);
}

using MultiFn = void (*)(const bf16* const*, int64_t, const bf16*, int64_t, float*);

// `tile_multi` for one pass of `chunks` (1 or 2) 16-row tiles over `blocks` (1-3) blocks.
MultiFn pick_multi(int64_t chunks, int64_t blocks) {
  static constexpr MultiFn one[3] = {tile_multi<1, 1>, tile_multi<1, 2>, tile_multi<1, 3>};
  static constexpr MultiFn two[3] = {tile_multi<2, 1>, tile_multi<2, 2>, tile_multi<2, 3>};
  return (chunks == 1 ? one : two)[blocks - 1];
}
#endif

#if LLM_HAVE_AVX512
// One output row of a block: dst[0..16) = bf16(row[0..16) + bias), rounded to nearest even exactly as
// from_float<bf16> rounds, 16 lanes at once (GCC leaves the scalar loop with its bias test unvectorized);
// bit-identical to the scalar rounding.
inline void store_row16(bf16* dst, const float* row, const bf16* bias) {
  __m512 v = _mm512_load_ps(row);
  if (bias) {
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias)));
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
  }
  __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

// The same row unrounded: dst[0..16) = row[0..16) + bias in fp32 (a bf16 GEMM's fp32 output, e.g. logits).
inline void store_row16(float* dst, const float* row, const bf16* bias) {
  __m512 v = _mm512_load_ps(row);
  if (bias) {
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias)));
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
  }
  _mm512_storeu_ps(dst, v);
}

#endif

// Lines [k * step, min((k + 1) * step, lines)) of `pf` prefetched into L2: a block function's share of the next
// group's weights, spread over its K steps (see small_gemm_vector).
inline void prefetch_share(const char* pf, int64_t lines, int64_t step, int64_t k) {
  const int64_t end = std::min(lines, (k + 1) * step);
  for (int64_t i = k * step; i < end; ++i) __builtin_prefetch(pf + 64 * i, 0, 1);
}

// The group of 4 blocks a thread most likely takes next (threads take groups in turn), prefetched into L2 while the
// rows pass over its current group, a share per pass of 6 rows: else each group's first pass waits on memory. None
// with a single pass.
struct NextGroup {
  const char* base = nullptr;
  int64_t lines = 0, passes;
  // ws: the packed weights (NB blocks of K x 16); g: the current group of `groups`; M rows.
  template <typename T>
  NextGroup(const T* ws, int64_t g, int64_t threads, int64_t groups, int64_t NB, int64_t K, int64_t M)
      : passes((M + 5) / 6) {
    const int64_t next = g + threads;
    if (passes >= 2 && next < groups) {
      lines = std::min<int64_t>(4, NB - 4 * next) * K * 16 * static_cast<int64_t>(sizeof(T)) / 64;
      base = reinterpret_cast<const char*>(ws + 4 * next * K * 16);
    }
  }
  // Pass `pass`'s share: its first line (nullptr: nothing to prefetch) and how many lines.
  const char* share(int64_t pass) const { return lines ? base + 64 * (pass * lines / passes) : nullptr; }
  int64_t share_lines(int64_t pass) const { return (pass + 1) * lines / passes - pass * lines / passes; }
};

#if LLM_HAVE_AVX512_BF16
// bf16 without AMX (AVX512-BF16, e.g. AMD Zen 4): rows x[0..MB) against NB consecutive blocks of 16 outputs in the
// tile layout (block j at w + j * stride: K / 2 vectors of 16 outputs x 2 consecutive k), with vdpbf16ps: each
// row's pair (x[2p], x[2p + 1]) broadcast to every lane, c[m * 64 + 16 * j + n] = sum_k x[m][k] w_j[n][k] in fp32.
template <int MB, int NB>
inline void dp_block(const bf16* x, int64_t K, const bf16* w, int64_t stride, float* c,
                     const char* pf = nullptr, int64_t pf_lines = 0) {
  const int64_t pf_step = pf ? (pf_lines + K / 2 - 1) / (K / 2) : 0;
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    prefetch_share(pf, pf_lines, pf_step, p);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * stride + 32 * p);
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

#if LLM_HAVE_AVX512
// Rows x[0..MB) (K apart) against NB consecutive blocks of 16 outputs (weights [K][16] per block, blocks `stride`
// apart) over k in [0, kc): c[m * 64 + 16 * j + n] = sum_k x[m][k] w_j[k][n], or, where `accumulate` (a later chunk
// of k), added to c in the same order (each output's sum one fp32 accumulator in k order, stored and reloaded
// exactly: the bits of one pass over all k). pf_lines lines at pf, and at each of pf_blocks - 1 further blocks
// `stride` apart, are prefetched into L2 over the loop.
template <int MB, int NB>
inline void fma_block(const float* x, int64_t K, int64_t kc, const float* w, int64_t stride, float* c,
                      bool accumulate, const char* pf = nullptr, int64_t pf_lines = 0, int64_t pf_blocks = 1) {
  const int64_t pf_step = pf ? (pf_lines + kc - 1) / kc : 0;
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = accumulate ? _mm512_loadu_ps(c + m * 64 + 16 * j) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t b = 0; pf && b < pf_blocks; ++b)
      prefetch_share(pf + b * stride * static_cast<int64_t>(sizeof(float)), pf_lines, pf_step, k);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * stride + 16 * k);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(c + m * 64 + 16 * j, acc[m][j]);
}

#endif

#if LLM_HAVE_AVX2_FMA
// Weights of one block of 16 outputs on AVX2, as two 8-lane fp32 vectors per k: W float in the fp32 layout
// ([K][16]: k's 16 outputs at w + 16 k); W bf16 in the pair layout ([K / 2][16][2]: pair p's 32 values at w + 32 p,
// each 32-bit lane one output's k = 2p in its low half, 2p + 1 in its high half), widened exactly in registers: the
// even k by a shift, the odd k by a mask (one load-and-op each, so no register holds the raw pair). A bf16 decode
// step reads half the bytes of fp32; the multiply-adds are fp32's. KS: the k a loop step takes (a pair for bf16), so
// that `parity` (k's, within the step) is a constant where the loops unroll.
template <typename W>
constexpr int KS = std::is_same_v<W, bf16> ? 2 : 1;

template <typename W>
inline __m256 weights8(const W* w, int64_t k, int parity, int half) {
  if constexpr (std::is_same_v<W, bf16>) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * k + 16 * half));  // k even: pair k / 2
    return _mm256_castsi256_ps(parity ? _mm256_and_si256(v, _mm256_set1_epi32(-65536)) : _mm256_slli_epi32(v, 16));
  } else {
    return _mm256_loadu_ps(w + 16 * (k + parity) + 8 * half);
  }
}

// fma_block on AVX2: a block of 16 outputs is two 8-lane registers. MB * NB <= 4 keeps the 2 * MB * NB
// accumulators, the block's weights and a broadcast row value within the 16 registers.
template <int MB, int NB, typename W>
inline void fma_block_avx2(const float* x, int64_t K, const W* w, int64_t stride, float* c,
                           const char* pf = nullptr, int64_t pf_lines = 0) {
  const int64_t pf_step = pf ? (pf_lines + K - 1) / K : 0;
  __m256 acc[MB][NB][2];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j][0] = acc[m][j][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += KS<W>) {
#pragma GCC unroll 2
    for (int s = 0; s < KS<W>; ++s) {
      prefetch_share(pf, pf_lines, pf_step, k + s);
      __m256 wv[NB][2];
      for (int j = 0; j < NB; ++j) {
        wv[j][0] = weights8(w + j * stride, k, s, 0);
        wv[j][1] = weights8(w + j * stride, k, s, 1);
      }
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * K + k + s);
        for (int j = 0; j < NB; ++j) {
          acc[m][j][0] = _mm256_fmadd_ps(xv, wv[j][0], acc[m][j][0]);
          acc[m][j][1] = _mm256_fmadd_ps(xv, wv[j][1], acc[m][j][1]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      _mm256_storeu_ps(c + m * 64 + 16 * j, acc[m][j][0]);
      _mm256_storeu_ps(c + m * 64 + 16 * j + 8, acc[m][j][1]);
    }
}

// Rows x[0..rows) (rows <= AVX2_STREAM_ROWS) against `nbs` (<= 4) blocks of 16 outputs into c (as fma_block):
// one row streams all four blocks at once; two rows take the blocks two at a time.
template <typename W>
inline void fma_rows_avx2(const float* x, int64_t rows, int64_t K, const W* w, int64_t stride, int64_t nbs,
                          float* c, const char* pf, int64_t pf_lines) {
  for (int64_t m = 0; m < rows; m += 2) {
    const float* xm = x + m * K;
    float* cm = c + m * 64;
    if (rows - m == 1) {
      if (nbs == 4) fma_block_avx2<1, 4>(xm, K, w, stride, cm, pf, pf_lines);
      else for (int64_t j = 0; j < nbs; ++j) fma_block_avx2<1, 1>(xm, K, w + j * stride, stride, cm + 16 * j);
    } else {
      int64_t j = 0;
      for (; j + 2 <= nbs; j += 2)
        fma_block_avx2<2, 2>(xm, K, w + j * stride, stride, cm + 16 * j, j == 0 ? pf : nullptr, pf_lines);
      if (j < nbs) fma_block_avx2<2, 1>(xm, K, w + j * stride, stride, cm + 16 * j);
    }
    pf = nullptr;
  }
}

// MB (1-6) rows against one block of 16 outputs over k in [0, kc), the 6 x 16 register block of BLIS's Haswell
// sgemm kernel (Van Zee & van de Geijn, "BLIS", ACM TOMS 2015; 12 accumulators, the block's two weight vectors, a
// broadcast row value): c[m * 16 + n] (+)= sum_k x[m * ldx + k] w[k][n] (weights8's layouts), k in order, so
// splitting K into chunks (accumulate: start from c) gives the same sums bit for bit. Lines pf + 64 * i for
// i < pf_lines are prefetched into L2: fp32 weights spread evenly over the k; bf16 weights (widened here) one per k
// from the first (pf_lines <= kc), which measured faster for them (the spread took 1.4-1.5x the time at 8-12 rows
// of the 1.7B shape's layers on a Zen 3).
template <int MB, typename W>
inline void fma_tile_avx2(const float* x, int64_t ldx, int64_t kc, const W* w, float* c, bool accumulate,
                          const char* pf, int64_t pf_lines) {
  // Every loop over rows unrolled: GCC otherwise keeps the accumulators in memory, a store per multiply-add.
  __m256 acc[MB][2];
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m) {
    acc[m][0] = accumulate ? _mm256_load_ps(c + 16 * m) : _mm256_setzero_ps();
    acc[m][1] = accumulate ? _mm256_load_ps(c + 16 * m + 8) : _mm256_setzero_ps();
  }
  // pf_lines / kc lines per k, the remainder carried over (as in Bresenham's line). Issued in a burst at the start
  // of the pass instead, they filled the core's queue of misses and the multiply-adds waited behind them: 12-27
  // rows ran at 80-130 GFLOP/s on weights streamed from memory against 150-180 on weights in L2 (Zen 3).
  int64_t pf_due = 0, pf_i = 0;
  for (int64_t k = 0; k < kc; k += KS<W>) {
#pragma GCC unroll 2
    for (int s = 0; s < KS<W>; ++s) {
      if constexpr (KS<W> == 1) {
        for (pf_due += pf_lines; pf_due >= kc; pf_due -= kc) __builtin_prefetch(pf + 64 * pf_i++, 0, 1);
      } else if (k + s < pf_lines) {
        __builtin_prefetch(pf + 64 * (k + s), 0, 1);
      }
      const __m256 w0 = weights8(w, k, s, 0), w1 = weights8(w, k, s, 1);
#pragma GCC unroll 6
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k + s);
        acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
      }
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m) {
    _mm256_store_ps(c + 16 * m, acc[m][0]);
    _mm256_store_ps(c + 16 * m + 8, acc[m][1]);
  }
}
#endif

}  // namespace
}  // namespace llm_cpu

// Whether this build and this process can run small_gemm for bf16 (AMX: the kernel asks Linux for the tile state
// once; AVX512-BF16; or AVX2 and FMA, on a CPU without AVX-512) or for fp32 (AVX-512, AVX2 and FMA) weights. An AVX2
// build (an image built for many nodes: LLM_CPU_KERNELS_MARCH) on a CPU with AVX-512 leaves bf16 to oneDNN, which
// has bf16 GEMMs there (AMX or AVX512-BF16 instructions, or AVX-512 conversions).
bool small_gemm_available(bool bf16) {
  if (!bf16) return LLM_HAVE_AVX512 || LLM_HAVE_AVX2_FMA;
  static const bool avx2_cpu = LLM_HAVE_AVX2_FMA && !__builtin_cpu_supports("avx512f");
  return llm_cpu::amx_usable() || LLM_HAVE_AVX512_BF16 || avx2_cpu;
}

// The most rows small_gemm takes for bf16 or fp32 here: 64 on AMX tiles, 256 on vector units, any number on AVX2
// (INT64_MAX).
int64_t small_gemm_max_rows(bool bf16) {
  if (LLM_HAVE_AVX2_FMA) return llm_cpu::AVX2_GEMM_MAX_ROWS;
  return bf16 && llm_cpu::amx_usable() ? llm_cpu::SMALL_GEMM_MAX_ROWS : llm_cpu::VECTOR_GEMM_MAX_ROWS;
}

// weight [N, K], N % 16 == 0 -> bf16 (K % 32 == 0): [N / 16, K / 2, 16, 2], for each 16 outputs every pair of
// consecutive k of each output, the layout of AMX's B tiles (1 KiB each: 16 pairs x 16 outputs); fp32:
// [N / 16, K, 16], each k's 16 outputs one vector.
torch::Tensor small_gemm_pack(torch::Tensor weight) {
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(weight.dim() == 2 && (bf16 || weight.scalar_type() == at::kFloat) && weight.size(0) % 16 == 0
              && (!bf16 || weight.size(1) % 32 == 0), "small_gemm_pack: bf16 or fp32 [N, K], N % 16 == 0, "
              "bf16 K % 32 == 0");
  const int64_t N = weight.size(0), K = weight.size(1);
  torch::Tensor tiles = bf16 ? weight.reshape({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3})
                             : weight.reshape({N / 16, 16, K}).permute({0, 2, 1});
  return llm_cpu::empty_on_huge_pages(tiles.sizes(), tiles.options()).copy_(tiles);
}

// small_gemm without AMX: fp32 with AVX-512 multiply-adds, bf16 with AVX512-BF16 dot products; on AVX2, weights of
// either type with 8-lane fp32 multiply-adds (x fp32: bf16 rows widened by the caller). Threads take groups of 4
// blocks of 16 outputs as they go; each group's weights stream from memory once, and the rows go through them 6 at
// a time (the later passes find the group in L2).
template <typename T, typename Y = T>
static void small_gemm_vector(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                              c10::optional<torch::Tensor> bias) {
  using namespace llm_cpu;
  constexpr bool BF16 = std::is_same_v<T, bf16>;
  using X = std::conditional_t<LLM_HAVE_AVX2_FMA, float, T>;
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 16;
  const X* xs = reinterpret_cast<const X*>(x.data_ptr());
  const T* ws = reinterpret_cast<const T*>(packed.data_ptr());
  const T* bs = bias ? reinterpret_cast<const T*>(bias->data_ptr()) : nullptr;
  Y* ys = reinterpret_cast<Y*>(out.data_ptr());
  const int64_t groups = (NB + 3) / 4;
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), groups)))
  {
    alignas(64) float c[6 * 64];
    for (int64_t g = taken.fetch_add(1); g < groups; g = taken.fetch_add(1)) {
      const int64_t nb0 = 4 * g, nbs = std::min<int64_t>(4, NB - nb0);
      const T* w = ws + nb0 * K * 16;
      const NextGroup next(ws, g, omp_get_num_threads(), groups, NB, K, M);
      for (int64_t m0 = 0; m0 < M; m0 += 6) {
        const int64_t rows = std::min<int64_t>(6, M - m0), pass = m0 / 6;
        const char* pf = next.share(pass);
        const int64_t pf_lines = next.share_lines(pass);
        if constexpr (BF16) {
#if LLM_HAVE_AVX512_BF16
          with_constant<6>(rows, [&](auto mb) {
            constexpr int MB = decltype(mb)::value;
            if (nbs == 4) dp_block<MB, 4>(xs + m0 * K, K, w, K * 16, c, pf, pf_lines);
            else for (int64_t j = 0; j < nbs; ++j) dp_block<MB, 1>(xs + m0 * K, K, w + j * K * 16, K * 16, c + 16 * j);
          });
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t j = 0; j < nbs; ++j)
              store_row16(ys + (m0 + m) * N + (nb0 + j) * 16, c + m * 64 + 16 * j, bs ? bs + (nb0 + j) * 16 : nullptr);
#elif LLM_HAVE_AVX2_FMA
          fma_rows_avx2(xs + m0 * K, rows, K, w, K * 16, nbs, c, pf, pf_lines);
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t n = 0; n < 16 * nbs; ++n)  // bias added in fp32, rounded once (as store_row16)
              ys[(m0 + m) * N + nb0 * 16 + n] = from_float<Y>(c[m * 64 + n] + (bs ? to_float(bs[nb0 * 16 + n]) : 0.f));
#endif
        } else {
#if LLM_HAVE_AVX2_FMA
          fma_rows_avx2(xs + m0 * K, rows, K, w, K * 16, nbs, c, pf, pf_lines);
#endif
#if LLM_HAVE_AVX2_FMA || LLM_HAVE_AVX512
#if LLM_HAVE_AVX512
          with_constant<6>(rows, [&](auto mb) {
            constexpr int MB = decltype(mb)::value;
            if (nbs == 4) fma_block<MB, 4>(xs + m0 * K, K, K, w, K * 16, c, false, pf, pf_lines);
            else for (int64_t j = 0; j < nbs; ++j)
              fma_block<MB, 1>(xs + m0 * K, K, K, w + j * K * 16, K * 16, c + 16 * j, false);
          });
#endif
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t n = 0; n < 16 * nbs; ++n)
              ys[(m0 + m) * N + nb0 * 16 + n] = c[m * 64 + n] + (bs ? bs[nb0 * 16 + n] : 0.f);
#endif
        }
      }
    }
  }
}

#if LLM_HAVE_AVX2_FMA
// fp32 and bf16 on AVX2 past AVX2_STREAM_ROWS rows, in the loop order of BLIS (Van Zee & van de Geijn, ACM TOMS 2015,
// sec. 4): the rows in panels whose chunk of x (panel rows x AVX2_K_CHUNK, at most AVX2_PANEL_BYTES) stays in L2,
// and within a panel, one block of 16 outputs at a time, the panel's rows through it in passes of up to 6
// (fma_tile_avx2, rows spread evenly over the passes) and K in chunks: a chunk of the block (at most 64 KiB) stays in
// L2 from the first pass, which streams it from memory, to the last. Threads take (panel, block) items in order,
// so both work on the same panel of x at a time. The chunk whose first pass comes next is prefetched into L2 over
// the passes of the current chunk, a share per pass: the item's next chunk; over its last chunk, where the item has
// two or more passes, the first chunk of the item the thread most likely takes next (the threads take items in
// turn). So a first pass does not wait on memory (as NextGroup does for the paths above).
// W: the weights' and bias's type (fp32, or bf16 in the pair layout); Y: the output's (W, or fp32 for bf16 W: the sums
// unrounded; bf16 rounded once at the store); x fp32.
template <typename W, typename Y = W>
static void small_gemm_avx2_rows(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                                 c10::optional<torch::Tensor> bias) {
  using namespace llm_cpu;
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), N = NB * 16;
  const float* xs = x.data_ptr<float>();
  const W* ws = reinterpret_cast<const W*>(packed.data_ptr());
  const W* bs = bias ? reinterpret_cast<const W*>(bias->data_ptr()) : nullptr;
  Y* ys = reinterpret_cast<Y*>(out.data_ptr());
  const int64_t kc_max = std::min(AVX2_K_CHUNK, K);
  const int64_t panel_max = std::clamp<int64_t>(AVX2_PANEL_BYTES / (kc_max * 4) / 6 * 6, 6, AVX2_PANEL_MAX_ROWS);
  const int64_t panels = (M + panel_max - 1) / panel_max;
  const int64_t items = NB * panels;
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), items)))
  {
    alignas(64) float c[AVX2_PANEL_MAX_ROWS * 16];
    std::unique_ptr<float[]> wide_storage;  // bf16: a chunk of weights widened, allocated at first use (not zeroed)
    float* wide = nullptr;
    const int64_t threads = omp_get_num_threads();
    for (int64_t item = taken.fetch_add(1); item < items; item = taken.fetch_add(1)) {
      const int64_t panel = item / NB, nb = item % NB;
      const int64_t r0 = panel * M / panels, r1 = (panel + 1) * M / panels;  // the panel's rows, spread evenly
      const int64_t passes = (r1 - r0 + 5) / 6;
      const W* w = ws + nb * K * 16;
      const int64_t next = item + threads;
      const char* next_w = passes >= 2 && next < items ? reinterpret_cast<const char*>(ws + next % NB * K * 16) : nullptr;
      for (int64_t k0 = 0; k0 < K; k0 += AVX2_K_CHUNK) {
        const int64_t kc = std::min(AVX2_K_CHUNK, K - k0);
        // The weights the next first pass reads, a share per pass of this chunk: the item's next chunk, else the
        // next item's first chunk (bf16 widened in the passes, as before the spread: the next item's, at most kc).
        const bool last = k0 + kc == K, bf16_passes = std::is_same_v<W, bf16> && passes < 3;
        const char* pf = last ? next_w : bf16_passes ? nullptr : reinterpret_cast<const char*>(w + (k0 + kc) * 16);
        int64_t pf_lines = !pf ? 0 : (last ? kc_max : std::min(AVX2_K_CHUNK, K - k0 - kc))
                                         * 16 * static_cast<int64_t>(sizeof(W)) / 64;
        if (bf16_passes) pf_lines = std::min(pf_lines, kc);
        // bf16 weights that three or more passes read: the chunk widened to fp32 once, into `wide` (64 KiB, in L2
        // beside the panel), and the passes run fp32's loop on it; widened in every pass, they ran 1.3-1.5x fp32's time.
        const float* widened = nullptr;
        if constexpr (std::is_same_v<W, bf16>) {
          if (passes >= 3) {
            if (!wide) {
              wide_storage.reset(new float[AVX2_K_CHUNK * 16 + 16]);
              wide = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(wide_storage.get()) + 63) & ~uintptr_t{63});
            }
            for (int64_t k = 0; k < kc; k += 2)
              for (int s = 0; s < 2; ++s)
                for (int half = 0; half < 2; ++half)
                  _mm256_store_ps(wide + 16 * (k + s) + 8 * half, weights8(w + k0 * 16, k, s, half));
            widened = wide;
          }
        }
        for (int64_t p = 0, m0 = r0; p < passes; ++p) {
          const int64_t rows = (r1 - m0) / (passes - p);  // the remaining rows over the remaining passes
          const int64_t first = p * pf_lines / passes, share = (p + 1) * pf_lines / passes - first;
          with_constant<6>(rows, [&](auto mb) {
            constexpr int MB = decltype(mb)::value;
            const float* x = xs + m0 * K + k0;
            float* cm = c + (m0 - r0) * 16;
            if (widened) fma_tile_avx2<MB>(x, K, kc, widened, cm, k0 > 0, pf + 64 * first, share);
            else fma_tile_avx2<MB>(x, K, kc, w + k0 * 16, cm, k0 > 0, pf + 64 * first, share);
          });
          m0 += rows;
        }
      }
      for (int64_t m = r0; m < r1; ++m)
        for (int64_t n = 0; n < 16; ++n)
          ys[m * N + nb * 16 + n] = from_float<Y>(c[(m - r0) * 16 + n] + (bs ? to_float(bs[nb * 16 + n]) : 0.f));
    }
  }
}
#endif

#if LLM_HAVE_AVX512
// An fp32 small_gemm call's operands (x [M, K], packed weights [NB, K, 16], bias [N] or none, out [M, N]), and the
// store of one group of 4 blocks' sums (c: M rows 64 apart) into out with the bias.
struct Fp32Operands {
  int64_t M, K, NB, N, stride;
  const float* xs;
  const float* ws;
  const float* bs;
  float* ys;
  Fp32Operands(torch::Tensor out, torch::Tensor x, torch::Tensor packed, const c10::optional<torch::Tensor>& bias)
      : M(x.size(0)), K(x.size(1)), NB(packed.size(0)), N(NB * 16), stride(K * 16), xs(x.data_ptr<float>()),
        ws(packed.data_ptr<float>()), bs(bias ? bias->data_ptr<float>() : nullptr), ys(out.data_ptr<float>()) {}
  void store_group(int64_t g, const float* c) const {
    const int64_t nb0 = 4 * g, nbs = std::min<int64_t>(4, NB - nb0);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < 16 * nbs; ++n)
        ys[m * N + nb0 * 16 + n] = c[m * 64 + n] + (bs ? bs[nb0 * 16 + n] : 0.f);
  }
};

// Rows x[0..MB) (`xs` apart) against one group of 4 blocks of 16 outputs (blocks `stride` apart) over k in [0, kc),
// into c (64-byte aligned, rows 64 apart), or added to it where `accumulate`: fma_block<MB, 4>'s arithmetic in the
// same order, without its prefetching, for the prompt slices' panels (whose weights come from L2, not memory).
// The plain loop matters there: fma_block's per-k prefetch bookkeeping cost about 8% of a 256-row layer.
template <int MB>
inline void fma_group(const float* __restrict x, int64_t xs, int64_t kc, const float* __restrict w, int64_t stride,
                      float* __restrict c, bool accumulate) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = accumulate ? _mm512_load_ps(c + m * 64 + 16 * j) : _mm512_setzero_ps();
  const float* w1 = w + stride;
  const float* w2 = w + 2 * stride;
  const float* w3 = w + 3 * stride;
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(w + 16 * k), b1 = _mm512_loadu_ps(w1 + 16 * k);
    const __m512 b2 = _mm512_loadu_ps(w2 + 16 * k), b3 = _mm512_loadu_ps(w3 + 16 * k);
    for (int m = 0; m < MB; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * xs + k]);
      acc[m][0] = _mm512_fmadd_ps(a, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, b1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(a, b2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(a, b3, acc[m][3]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) _mm512_store_ps(c + m * 64 + 16 * j, acc[m][j]);
}

// fp32 on AVX-512 past PANEL_MIN_ROWS rows (prompt slices): the loop order of BLIS (Van Zee & van de Geijn, ACM
// TOMS 2015, sec. 4) with the roles of its operands as this layout has them: a thread takes a block of up to
// PANEL_GROUPS groups of 64 outputs; per chunk of PANEL_K_CHUNK k, the block's weights for the chunk (128 KiB)
// stay in L2 while every pass of 6 rows reads them, each pass's rows (6 x 512 bytes) in L1 across the block's
// groups. The sums of all M rows of the block's outputs are kept in c between chunks. Each output's sum runs in
// k order in one accumulator, stored and reloaded exactly between chunks: the bits of small_gemm_vector, and of
// one row alone (batch invariance). On a 256-row slice of the 1.7B shape's layer, 1.02x oneDNN's fp32 GEMM's speed
// where small_gemm_fp32_chunked's order gave 0.84x; below about 96 rows that order is as fast (docs/kernels.md).
static void small_gemm_fp32_panels(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                                   c10::optional<torch::Tensor> bias) {
  using namespace llm_cpu;
  const Fp32Operands op(out, x, packed, bias);
  const int64_t M = op.M, K = op.K, NB = op.NB, stride = op.stride;
  const float* xs = op.xs;
  const float* ws = op.ws;
  // Blocks of fewer groups where there are few groups per thread, so that every thread gets blocks.
  const int64_t groups = (NB + 3) / 4, threads = at::get_num_threads();
  const int64_t G = std::clamp<int64_t>(groups / (2 * threads), 1, PANEL_GROUPS), blocks = (groups + G - 1) / G;
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, blocks)))
  {
    std::unique_ptr<float[]> c_storage(new float[G * M * 64 + 16]);  // per group: M rows x 64 sums
    float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(c_storage.get()) + 63) & ~uintptr_t{63});
    for (int64_t b = taken.fetch_add(1); b < blocks; b = taken.fetch_add(1)) {
      const int64_t g0 = b * G, g1 = std::min(groups, g0 + G);
      for (int64_t k0 = 0; k0 < K; k0 += PANEL_K_CHUNK) {
        const int64_t kc = std::min(PANEL_K_CHUNK, K - k0);
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
          const float* xm = xs + m0 * K + k0;
          for (int64_t g = g0; g < g1; ++g) {
            const int64_t nbs = std::min<int64_t>(4, NB - 4 * g);
            const float* w = ws + 4 * g * stride + k0 * 16;
            float* cm = c + (g - g0) * M * 64 + m0 * 64;
            with_constant<6>(std::min<int64_t>(6, M - m0), [&](auto mb) {
              constexpr int MB = decltype(mb)::value;
              if (nbs == 4) fma_group<MB>(xm, K, kc, w, stride, cm, k0 > 0);
              else for (int64_t j = 0; j < nbs; ++j)
                fma_block<MB, 1>(xm, K, kc, w + j * stride, stride, cm + 16 * j, k0 > 0);
            });
          }
        }
      }
      for (int64_t g = g0; g < g1; ++g) op.store_group(g, c + (g - g0) * M * 64);
    }
  }
}

// fp32 on AVX-512 over more than one pass of 6 rows, up to PANEL_MIN_ROWS, where K is past VECTOR_CHUNK_MIN_K: a
// group's weights (K x 64 fp32: 256 bytes per k; the 1.7B shape's down projection, K = 8192, 2 MiB) would be read
// from L2 or beyond by every pass. As small_gemm_vector, with K in chunks of VECTOR_K_CHUNK k (16 KiB of the
// group's weights, in L1), each chunk read by every pass of 6 rows before the next (the loop order of BLIS, Van Zee
// & van de Geijn, ACM TOMS 2015, sec. 4: the micro-panel of weights in L1), the sums of all M rows kept in c between chunks. The weights the
// next chunk's first pass reads (the group's next chunk, else the first chunk of the group the thread most likely
// takes next) are prefetched over the passes, a share per pass. Each output's sum runs in k order in one
// accumulator, stored and reloaded exactly between chunks: the bits are small_gemm_vector's, and one row's alone
// (batch invariance).
static void small_gemm_fp32_chunked(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                                    c10::optional<torch::Tensor> bias) {
  using namespace llm_cpu;
  const Fp32Operands op(out, x, packed, bias);
  const int64_t M = op.M, K = op.K, NB = op.NB, stride = op.stride;
  const float* xs = op.xs;
  const float* ws = op.ws;
  const int64_t groups = (NB + 3) / 4, passes = (M + 5) / 6, chunk = VECTOR_K_CHUNK;
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), groups)))
  {
    std::unique_ptr<float[]> c_storage(new float[M * 64 + 16]);  // all M rows' sums for the group's 64 outputs
    float* c = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(c_storage.get()) + 63) & ~uintptr_t{63});
    const int64_t threads = omp_get_num_threads();
    for (int64_t g = taken.fetch_add(1); g < groups; g = taken.fetch_add(1)) {
      const int64_t nb0 = 4 * g, nbs = std::min<int64_t>(4, NB - nb0), next = g + threads;
      const float* w = ws + nb0 * stride;
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = std::min(chunk, K - k0);
        const bool last = k0 + kc == K;
        const float* pf_w = !last ? w + (k0 + kc) * 16 : next < groups ? ws + 4 * next * stride : nullptr;
        const int64_t pf_blocks = !last ? nbs : std::min<int64_t>(4, NB - 4 * next);
        const int64_t pf_lines = pf_w ? (last ? std::min(chunk, K) : std::min(chunk, K - k0 - kc))
                                            * 16 * static_cast<int64_t>(sizeof(float)) / 64 : 0;  // per block
        for (int64_t pass = 0, m0 = 0; m0 < M; ++pass, m0 += 6) {
          const int64_t first = pass * pf_lines / passes, share = (pass + 1) * pf_lines / passes - first;
          const char* pf = pf_w && share ? reinterpret_cast<const char*>(pf_w) + 64 * first : nullptr;
          const float* xm = xs + m0 * K + k0;
          float* cm = c + m0 * 64;
          with_constant<6>(std::min<int64_t>(6, M - m0), [&](auto mb) {
            constexpr int MB = decltype(mb)::value;
            if (nbs == 4) fma_block<MB, 4>(xm, K, kc, w + k0 * 16, stride, cm, k0 > 0, pf, share, pf_blocks);
            else for (int64_t j = 0; j < nbs; ++j)
              fma_block<MB, 1>(xm, K, kc, w + j * stride + k0 * 16, stride, cm + 16 * j, k0 > 0,
                               j == 0 ? pf : nullptr, share, pf_blocks);
          });
        }
      }
      op.store_group(g, c);
    }
  }
}
#endif

// out [M, N] = x [M, K] @ weight^T (+ bias [N], added in fp32), bf16 or fp32, M <= small_gemm_max_rows; packed
// from small_gemm_pack. out is x's dtype, or fp32 for bf16 x: the fp32 sums unrounded (the bf16 result is exactly
// their rounding).
void small_gemm(torch::Tensor out, torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  using namespace llm_cpu;
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(small_gemm_available(false), "small_gemm: neither AVX-512 nor AVX2 with FMA is available");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= small_gemm_max_rows(false)
                && packed.dim() == 3 && packed.size(1) == x.size(1) && packed.scalar_type() == at::kFloat,
                "small_gemm: x fp32 [M <= ", small_gemm_max_rows(false), ", K] contiguous, packed [N / 16, K, 16]");
    TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == packed.size(0) * 16
                && out.scalar_type() == at::kFloat, "small_gemm: out fp32 [M, N] contiguous");
    TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == out.size(1) && bias->scalar_type() == at::kFloat),
                "small_gemm: bias fp32 [N]");
#if LLM_HAVE_AVX2_FMA
    if (x.size(0) > AVX2_STREAM_ROWS) return small_gemm_avx2_rows<float>(out, x, packed, bias);
#endif
#if LLM_HAVE_AVX512
    if (x.size(0) > PANEL_MIN_ROWS) return small_gemm_fp32_panels(out, x, packed, bias);
    if (x.size(0) > 6 && x.size(1) > VECTOR_CHUNK_MIN_K) return small_gemm_fp32_chunked(out, x, packed, bias);
#endif
    return small_gemm_vector<float>(out, x, packed, bias);
  }
  TORCH_CHECK(small_gemm_available(true), "small_gemm: none of AMX, AVX512-BF16, or AVX2 with FMA on a CPU without "
              "AVX-512 is available for bf16");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && M >= 1
              && M <= small_gemm_max_rows(true) && packed.dim() == 4 && packed.size(1) * 2 == K && K % 32 == 0,
              "small_gemm: x bf16 [M <= ", small_gemm_max_rows(true), ", K] contiguous, packed [N / 16, K / 2, 16, 2]");
  const bool fp32_out = out.scalar_type() == at::kFloat;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == M && out.size(1) == N
              && (fp32_out || out.scalar_type() == at::kBFloat16), "small_gemm: out bf16 or fp32 [M, N] contiguous");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16),
              "small_gemm: bias bf16 [N]");
#if LLM_HAVE_AVX2_FMA
  {  // the rows widened to fp32 (exact) once; the weights widen in registers
    const torch::Tensor xf = x.to(at::kFloat);
    if (M > AVX2_STREAM_ROWS) {
      return fp32_out ? small_gemm_avx2_rows<bf16, float>(out, xf, packed, bias)
                      : small_gemm_avx2_rows<bf16>(out, xf, packed, bias);
    }
    return fp32_out ? small_gemm_vector<bf16, float>(out, xf, packed, bias)
                    : small_gemm_vector<bf16>(out, xf, packed, bias);
  }
#endif
  if (!amx_usable()) {
    return fp32_out ? small_gemm_vector<bf16, float>(out, x, packed, bias)
                    : small_gemm_vector<bf16>(out, x, packed, bias);
  }
#if LLM_HAVE_AMX
  const bf16* xs = reinterpret_cast<const bf16*>(x.data_ptr());
  const bf16* ws = reinterpret_cast<const bf16*>(packed.data_ptr());
  const bf16* bs = bias ? reinterpret_cast<const bf16*>(bias->data_ptr()) : nullptr;
  bf16* ys = fp32_out ? nullptr : reinterpret_cast<bf16*>(out.data_ptr());
  float* ys32 = fp32_out ? out.data_ptr<float>() : nullptr;
  const int64_t full = M / 16, tail = M % 16, chunks = (M + 15) / 16;
  // Over 16 rows: groups of up to MULTI_BLOCKS blocks, each read by passes of two 16-row chunks of x
  // (`tile_multi`; the second and later passes find the group's weights in L2), every chunk a full 16-row tile:
  // a partial last chunk is copied into 16 zero-padded rows first (its extra rows' results are dropped).
  const bool multi = chunks > 1;
  std::vector<bf16> padded(multi && tail ? 16 * K : 0, bf16{0});
  if (!padded.empty()) std::memcpy(padded.data(), xs + full * 16 * K, tail * K * sizeof(bf16));
  const bf16* a[SMALL_GEMM_MAX_ROWS / 16];
  for (int64_t i = 0; i < chunks; ++i) a[i] = i < full ? xs + i * 16 * K : padded.data();
  // Threads take runs of GEMM_RUN_BLOCKS 16-output blocks as they go (each run's weights stream from memory in order;
  // a thread the OS takes away for a while leaves the remaining runs to the others).
  const int64_t NB = N / 16;
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), NB)))
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t) { config.rows[t] = 16; config.colsb[t] = 64; }
    if (!multi) { config.rows[0] = static_cast<uint8_t>(M); config.rows[4] = static_cast<uint8_t>(M); }
    _tile_loadconfig(&config);
    alignas(64) float c[SMALL_GEMM_MAX_ROWS / 32 * 6 * 256];  // per pass, 6 C tiles
    for (int64_t run = taken.fetch_add(GEMM_RUN_BLOCKS); run < NB; run = taken.fetch_add(GEMM_RUN_BLOCKS)) {
      const int64_t run_end = std::min(NB, run + GEMM_RUN_BLOCKS);
      for (int64_t nb = run, count = 1; nb < run_end; nb += count) {
        if (multi) {
          count = std::min(MULTI_BLOCKS, run_end - nb);
          for (int64_t pass = 0; 2 * pass < chunks; ++pass)
            pick_multi(std::min<int64_t>(2, chunks - 2 * pass), count)(a + 2 * pass, K, ws + nb * K * 16, K * 16,
                                                                         c + pass * 6 * 256);
        } else {
          tile_block(xs, K, ws + nb * K * 16, c);
        }
        for (int64_t j = 0; j < count; ++j) {
          for (int64_t m = 0; m < M; ++m) {
            const int64_t i = m / 16;  // the row's chunk: in pass i / 2, C tile (i % 2) * count + j of it
            const float* row = c + ((i / 2) * 6 + (i % 2) * count + j) * 256 + (m % 16) * 16;
            const bf16* b = bs ? bs + (nb + j) * 16 : nullptr;
            if (ys32) store_row16(ys32 + m * N + (nb + j) * 16, row, b);
            else store_row16(ys + m * N + (nb + j) * 16, row, b);
          }
        }
      }
    }
    _tile_release();
  }
#endif
}
