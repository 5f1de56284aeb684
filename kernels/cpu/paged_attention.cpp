// Paged decode (and prefill) attention for CPUs: one query token per sequence, reading K/V blocks in place through the
// block table (PagedAttention, Kwon et al. SOSP 2023, sec. 4.1; vLLM's csrc/cpu has the same shape).
// One task per (sequence, KV head): the query heads that share the KV head (grouped-query attention) are
// scored together, so each key and value row is loaded once. Scores and accumulators are fp32.
//
// For head_dim 64 or 128 in fp32 or bf16 (`tile_kernel`) keys and values go by tiles of 16 tokens with an
// online softmax (Milakov & Gimelshein 2018; FlashAttention's rescaling, Dao et al. 2022): one pass over the
// cache, 16-float vectors throughout, and the 16 dot products of a tile summed across lanes together (a
// four-level shuffle tree) rather than one horizontal sum per key, as the per-key `generic_kernel` below does,
// so that reading the cache, not the arithmetic, bounds the kernel. The softmax of a tile runs on 16 lanes (AVX-512), and bf16
// keys are scored with AVX512-BF16's `vdpbf16ps` (pairs of exact products summed in fp32) where the CPU has it.
// With AMX (bf16, blocks of whole 16-token tiles) `amx_decode_kernel` scores the keys on tiles instead, so that
// the kernel's time is close to that of a plain reader of the same blocks.
// On CPUs with AVX2 but no AVX-512 the decode tiles (fp32, and bf16 widened as it loads) and the fp32 prefill block
// are written with 8-lane intrinsics instead (`attend_tile_avx2`, the AVX2 `attend_tile_block`): GCC lowers the
// 16-float vector type there through the stack.
// `generic_kernel` serves every other shape and fp16. `prefill_tile_kernel` (below) does the prompt rows of a
// step, causal, over the same blocks (FlashAttention's tiling over query rows and keys, Dao et al. 2022).
#include "common.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define LLM_AVX2_ONLY 1  // the 16-float vector type would be lowered to pairs of AVX2 registers through the stack
#endif

namespace llm_cpu {
namespace {

// Whether tile_kernel's AVX2 path reads T's cache rows in place (fp32 and bf16 there), rather than through fp32
// copies of each tile.
template <typename T>
#if defined(LLM_AVX2_ONLY)
constexpr bool AVX2_READS_IN_PLACE = std::is_same_v<T, float> || std::is_same_v<T, bf16>;
#else
constexpr bool AVX2_READS_IN_PLACE = false;
#endif

template <typename T>
void generic_kernel(T* out, const T* q, int64_t q_row_stride, const T* key_cache, const T* value_cache,
                   const int64_t* block_tables, const int64_t* seq_lens, int64_t batch, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // between tokens of a block
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), scores, maxima(group), sums(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t seq_len = seq_lens[seq];
      const int64_t* table = block_tables + seq * max_blocks;
      scores.resize(group * seq_len);
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q + seq * q_row_stride + (kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = to_float(src[d]) * scale;
        maxima[g] = -std::numeric_limits<float>::infinity();
      }
      for (int64_t t = 0; t < seq_len; ++t) {  // scores = q . k
        const T* key = key_cache + (table[t / block_size] * block_size + t % block_size) * row_stride
                       + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * to_float(key[d]);
          scores[g * seq_len + t] = dot;
          maxima[g] = std::max(maxima[g], dot);
        }
      }
      for (int64_t g = 0; g < group; ++g) {  // softmax numerators
        float sum = 0.f;
        float* row = scores.data() + g * seq_len;
        const float maximum = maxima[g];
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < seq_len; ++t) {
          row[t] = exp_nonpositive(row[t] - maximum);
          sum += row[t];
        }
        sums[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < seq_len; ++t) {  // acc = p . v
        const T* value = value_cache + (table[t / block_size] * block_size + t % block_size) * row_stride
                         + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * seq_len + t];
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * to_float(value[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out + (seq * num_heads + kv_head * group + g) * head_dim;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<T>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

inline vf16 load_vf16(const float* p) { vf16 f; std::memcpy(&f, p, sizeof(f)); return f; }
inline vf16 load_vf16(const bf16* p) {
  vh16 h; std::memcpy(&h, p, sizeof(h));
  vu16 u = __builtin_convertvector(h, vu16) << 16;
  vf16 f; std::memcpy(&f, &u, sizeof(f)); return f;
}
inline void store_vf16(float* p, vf16 v) { std::memcpy(p, &v, sizeof(v)); }

inline vf16 fold(vf16 x, vf16 y, vi16 a, vi16 b) { return __builtin_shuffle(x, y, a) + __builtin_shuffle(x, y, b); }

inline vf16 sum16(const vf16* v) {
  const vi16 a8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi16 b8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi16 a4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const vi16 b4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const vi16 a2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi16 b2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vi16 a1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi16 b1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  vf16 l1[8], l2[4], l3[2];
  for (int j = 0; j < 8; ++j) l1[j] = fold(v[2 * j], v[2 * j + 1], a8, b8);
  for (int j = 0; j < 4; ++j) l2[j] = fold(l1[2 * j], l1[2 * j + 1], a4, b4);
  for (int j = 0; j < 2; ++j) l3[j] = fold(l2[2 * j], l2[2 * j + 1], a2, b2);
  return fold(l3[0], l3[1], a1, b1);
}
constexpr int BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
constexpr int64_t MAX_KV_HEADS = 8;  // KV heads per task (their fp32 tiles: 2 x 8 x 16 x 128 x 4 B = 128 KiB)
constexpr int MAX_GROUP = 16;        // query heads per KV head

// Keys and values this many tokens ahead are prefetched (two tiles): blocks lie scattered in the pool and the
// hardware prefetchers stop at each block's end. Alone it gains nothing; with the bf16 dot product below it
// keeps the memory busy while a tile is scored (A/B at batch 48, context 150-400, 30 layers, bf16, 2 threads,
// cache out of the CPU's caches: 29.5 ms plain, 27.2 with the 16-lane softmax, 26.0 with all three).
constexpr int64_t PREFETCH_TOKENS = 32;

// The rows of the tile PREFETCH_TOKENS ahead, prefetched a little at a time inside the loops that read this tile.
// Issued all at once at the tile's start instead, the 16 rows' lines (24 KiB in fp32 for SmolLM2's three KV heads)
// overflow the core's queue of misses; the loads wait on memory and the arithmetic on the loads, in turn, where
// spread out the two overlap. Two ways:
// - `prefetch_row` (the 16-lane `attend_tile`, first query heads of each KV head): token i's key row while key i
//   is scored, its value row while value i is summed;
// - `next` (the AVX2 `attend_tile_avx2`): the later tile's lines as one stream in address order, keys then values
//   of all the task's KV heads, advanced by the first query heads of each KV head: a line per step of their
//   scores, and over their values twice the lines each pass reads, so that each KV head moves the stream on by
//   its own share of the tile and the misses are spread over the whole tile's arithmetic. A token's rows
//   prefetched as in `prefetch_row` gained nothing on a Zen 3 EPYC (AVX2, 2 threads, batch 27, context 250-600,
//   30 layers out of the caches: fp32 41-45 ms with and without them); this stream takes 27-32 ms there, and
//   bf16 21 ms against 24.
struct TilePrefetch {
  const char* keys[16];
  const char* values[16];
  int n = 0;
  int lines_per_row = 0;  // the task's KV heads' part of a row, in cache lines (`next`)
  int row = 0, line = 0;  // `next`'s place: rows 0..n-1 are the keys, n..2n-1 the values

  // Prefetches the next `count` cache lines of the stream (none once it has ended).
  inline void next(int count);
};

// prefetcht2 that the compiler keeps: GCC 12 drops __builtin_prefetch from the value loops below (it treats them as
// free of side effects when it transforms those loops; checked in the built library's disassembly).
inline void prefetch_t2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

inline void TilePrefetch::next(int count) {
  while (count > 0 && row < 2 * n) {
    const char* at = (row < n ? keys[row] : values[row - n]) + 64 * line;
    const int take = std::min(count, lines_per_row - line);
    for (int l = 0; l < take; ++l) prefetch_t2(at + 64 * l);
    count -= take;
    line += take;
    if (line == lines_per_row) { line = 0; ++row; }
  }
}

// Token i's key (KEYS) or value row of the later tile, `BYTES` from element offset kv_offset (one KV head), if the
// later tile has a token i.
template <typename T, int BYTES, bool KEYS>
inline void prefetch_row(const TilePrefetch* ahead, int i, int64_t kv_offset) {
  if (ahead == nullptr || i >= ahead->n) return;
  const char* row = (KEYS ? ahead->keys[i] : ahead->values[i]) + kv_offset * static_cast<int64_t>(sizeof(T));
  for (int b = 0; b < BYTES; b += 64) prefetch_t2(row + b);
}

#if defined(__AVX512F__)
// exp_nonpositive (common.h) on 16 lanes: the same polynomial, the power of two applied with vscalefps.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 y = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(LLM_AVX2_ONLY)
// exp_nonpositive (common.h) on 8 lanes: the same polynomial, the power of two set in the exponent bits.
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 y = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_floor_ps(y);
  const __m256 f = _mm256_sub_ps(y, n);
  __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float reduce8(__m256 v, bool max) {
  __m128 x = max ? _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
                 : _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 y = _mm_movehl_ps(x, x);
  x = max ? _mm_max_ps(x, y) : _mm_add_ps(x, y);
  y = _mm_shuffle_ps(x, x, 1);
  return _mm_cvtss_f32(max ? _mm_max_ss(x, y) : _mm_add_ss(x, y));
}

#endif

#if defined(__AVX512BF16__)
constexpr bool HAVE_BF16_DOT = true;
// sum over lanes of the result = q . k over D dimensions, products exact, fp32 sums (AVX512-BF16 vdpbf16ps).
template <int D>
inline vf16 dot_bf16(const bf16* q, const bf16* k) {
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c < D / 32; ++c) {
    __m512i qv = _mm512_loadu_si512(q + 32 * c), kv = _mm512_loadu_si512(k + 32 * c);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)qv, (__m512bh)kv);
  }
  return (vf16)acc;
}
#else
constexpr bool HAVE_BF16_DOT = false;
template <int D>
inline vf16 dot_bf16(const bf16*, const bf16*) { return vf16{}; }
#endif

// bf16 value row `row` (D dimensions) widened in registers, 32 at a time: the even dimensions by a shift, the odd
// ones by a mask (two operations, no shuffles, nothing stored), then a[g] += p[g * p_stride] * row for NG query
// heads. Accumulator 2c holds dimensions 32c, 32c + 2, ... and 2c + 1 the odd ones (`widened_index`); the sums and
// their order per dimension are those of a plain fp32 pass.
template <int D, int NG>
inline void accumulate_value_row(const bf16* row, const float* p, int64_t p_stride, vf16 (*a)[D / 16]) {
  constexpr int C = D / 16;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  vf16 even[C / 2], odd[C / 2];
  for (int c = 0; c < C / 2; ++c) {
    const __m512i raw = _mm512_loadu_si512(row + 32 * c);
    even[c] = (vf16)_mm512_slli_epi32(raw, 16);
    odd[c] = (vf16)_mm512_and_si512(raw, high);
  }
  for (int g = 0; g < NG; ++g) {
    const float pg = p[g * p_stride];
    for (int c = 0; c < C / 2; ++c) { a[g][2 * c] += pg * even[c]; a[g][2 * c + 1] += pg * odd[c]; }
  }
}

// Where dimension d lies in accumulators filled by `accumulate_value_row` (stored one after another).
constexpr int widened_index(int d) { return (d / 32) * 32 + (d % 2) * 16 + (d % 32) / 2; }

// `NG` query heads sharing one KV head against one tile of `n` (<= 16) keys, updating their running maxima, sums
// and accumulators (online softmax). The heads go together so that their dependency chains interleave (one head
// alone waits on its softmax, then on 16 multiply-adds in a row per accumulator). `q_raw[g]` / `key_rows[i] + kv_offset`: queries and keys as stored (bf16 dot products); `qv`: the
// queries in fp32, already scaled, NG x C vectors; `kt` / `vt`: the tile's keys / values in fp32, 16 x C vectors.
template <typename T, int D, bool BF16_DOT, int NG>
inline void attend_tile(const T* const* q_raw, const vf16* qv, const T* const* key_rows,
                        const T* const* value_rows, int64_t kv_offset, const vf16* kt, const vf16* vt, int n,
                        float scale, float* maximum, float* sum, vf16* acc, const TilePrefetch* ahead) {
  constexpr int C = D / 16;
  alignas(64) float scores[NG][16];
  for (int g = 0; g < NG; ++g) {
    // The 16 dot products unrolled, in registers with the head's query (a loop over i < n spills them and reloads
    // the query for each key).
    // Rows past n are the tile's last key again (see tile_kernel; in the fp32 tiles of bf16 without vdpbf16ps, the
    // previous tile's) and their lanes are masked below.
    vf16 qg[C];
    for (int c = 0; c < C; ++c) qg[c] = qv[g * C + c];
    vf16 dots[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      if (g == 0) prefetch_row<T, D * sizeof(T), true>(ahead, i, kv_offset);
      vf16 d;
      if constexpr (BF16_DOT) {
        d = dot_bf16<D>(q_raw[g], key_rows[i] + kv_offset);
      } else if constexpr (std::is_same_v<T, float>) {  // fp32 keys and values read in place, not copied into tiles
        // (a copy would only add traffic; the result is bit-identical)
        const float* key = key_rows[i] + kv_offset;
        d = qg[0] * load_vf16(key);
        for (int c = 1; c < C; ++c) d += qg[c] * load_vf16(key + 16 * c);
      } else {
        d = qg[0] * kt[i * C];
        for (int c = 1; c < C; ++c) d += qg[c] * kt[i * C + c];
      }
      dots[BITREV4[i]] = d;
    }
    if constexpr (BF16_DOT) {
      store_vf16(scores[g], sum16(dots) * scale);
    } else {
      store_vf16(scores[g], sum16(dots));
    }
  }
  float alpha[NG];
  for (int g = 0; g < NG; ++g) {
    float m, tile_sum;
#if defined(__AVX512F__)
    const __mmask16 valid = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                        _mm512_load_ps(scores[g]));
    m = std::max(maximum[g], _mm512_reduce_max_ps(s));
    const __m512 p = _mm512_maskz_mov_ps(valid, exp_nonpositive16(_mm512_sub_ps(s, _mm512_set1_ps(m))));
    tile_sum = _mm512_reduce_add_ps(p);
    _mm512_store_ps(scores[g], p);
#else
    m = maximum[g];
    for (int i = 0; i < n; ++i) m = std::max(m, scores[g][i]);
    tile_sum = 0.f;
    for (int i = 0; i < 16; ++i) {
      scores[g][i] = i < n ? exp_nonpositive(scores[g][i] - m) : 0.f;
      tile_sum += scores[g][i];
    }
#endif
    alpha[g] = exp_nonpositive(maximum[g] - m);
    maximum[g] = m;
    sum[g] = sum[g] * alpha[g] + tile_sum;
  }
  vf16 a[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = acc[g * C + c] * alpha[g];
  if constexpr (BF16_DOT) {  // bf16 values widened in registers (see accumulate_value_row)
    for (int i = 0; i < n; ++i) {
      prefetch_row<T, D * sizeof(T), false>(ahead, i, kv_offset);
      accumulate_value_row<D, NG>(value_rows[i] + kv_offset, &scores[0][i], 16, a);
    }
  } else {
    for (int i = 0; i < n; ++i) {
      prefetch_row<T, D * sizeof(T), false>(ahead, i, kv_offset);
      for (int g = 0; g < NG; ++g) {
        const float p = scores[g][i];
        if constexpr (std::is_same_v<T, float>) {
          for (int c = 0; c < C; ++c) a[g][c] += p * load_vf16(value_rows[i] + kv_offset + 16 * c);
        } else {
          for (int c = 0; c < C; ++c) a[g][c] += p * vt[i * C + c];
        }
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) acc[g * C + c] = a[g][c];
}

#if defined(LLM_AVX2_ONLY)
// 8 consecutive elements of a cache row as fp32: bf16 widened exactly (zero-extended to 32 bits, shifted up 16).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Lane j of the result = the sum of v[j]'s 8 lanes: eight horizontal sums in six hadds and one add (one reduction
// per 8 keys instead of one per key).
inline __m256 sum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // lanes 0-3 of v[0..3] | lanes 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// acc[h] = acc[h] * alpha[h] + sum_i p[h][i] * v_i over the tile's n value rows, for NH (<= 4) query heads of one
// KV head, 8 x V dimensions at a time, each row's part loaded once for all NH heads. V makes 8 to 12 accumulators
// (NH x V independent multiply-add chains): with fewer, each chain waits on its last multiply-add (4 cycles) and
// both FMA pipes are not kept busy (one head alone at 16 dimensions a pass had two chains). `ahead`, where given,
// moves on by twice the lines each row's pass reads (the later tile's keys and values): one KV head's share of the
// stream over all the passes.
template <typename T, int D, int NH>
inline void accumulate_values_avx2(const T* const* value_rows, int64_t kv_offset, int n,
                                   const float (*p)[16], const float* alpha, float* acc, TilePrefetch* ahead) {
  constexpr int V = NH == 1 ? 8 : NH == 4 ? 2 : 4;
  constexpr int LINES = std::max<int>(1, 2 * 8 * V * static_cast<int>(sizeof(T)) / 64);
  static_assert(D % (8 * V) == 0, "head_dim must be a multiple of the pass");
  for (int c0 = 0; c0 < D; c0 += 8 * V) {
    __m256 a[NH][V];
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      const __m256 scale = _mm256_set1_ps(alpha[h]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) a[h][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + c0 + 8 * v), scale);
    }
    for (int i = 0; i < n; ++i) {
      if (ahead != nullptr) ahead->next(LINES);
      const T* row = value_rows[i] + kv_offset + c0;
      __m256 pb[NH];
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h) pb[h] = _mm256_broadcast_ss(&p[h][i]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const __m256 x = load8(row + 8 * v);
#pragma GCC unroll 4
        for (int h = 0; h < NH; ++h) a[h][v] = _mm256_fmadd_ps(pb[h], x, a[h][v]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc + h * D + c0 + 8 * v, a[h][v]);
  }
}

// Scores of NH (<= 4) query heads (`q`: fp32, scaled, D floats each) against the tile's bf16 keys, 8 keys a half:
// each 8 dimensions of a key are widened once for all NH heads (KB keys x NH heads of independent multiply-add
// chains, the queries as the multiply-adds' memory operands), then each head's 8 dot products are summed across
// lanes by `sum8x8`. The same sums in the same order as one head at a time. `ahead`, where given, moves on a line
// per step over the dimensions of the first KB keys.
template <int D, int NH>
inline void score_keys_bf16(const float* q, const bf16* const* key_rows, int64_t kv_offset, int halves,
                            float (*scores)[16], TilePrefetch* ahead) {
  constexpr int KB = NH == 1 ? 8 : NH == 4 ? 2 : 4;
  for (int half = 0; half < halves; ++half) {
    alignas(32) float dots[NH][8][8];
    for (int k0 = 0; k0 < 8; k0 += KB) {
      const bf16* key[KB];
#pragma GCC unroll 8
      for (int k = 0; k < KB; ++k) key[k] = key_rows[8 * half + k0 + k] + kv_offset;
      __m256 a[NH][KB];
#pragma GCC unroll 8
      for (int k = 0; k < KB; ++k) {
        const __m256 x = load8(key[k]);
#pragma GCC unroll 4
        for (int h = 0; h < NH; ++h) a[h][k] = _mm256_mul_ps(_mm256_loadu_ps(q + h * D), x);
      }
      for (int d = 8; d < D; d += 8) {
        if (ahead != nullptr && k0 == 0) ahead->next(1);
#pragma GCC unroll 8
        for (int k = 0; k < KB; ++k) {
          const __m256 x = load8(key[k] + d);
#pragma GCC unroll 4
          for (int h = 0; h < NH; ++h) a[h][k] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), x, a[h][k]);
        }
      }
#pragma GCC unroll 4
      for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
        for (int k = 0; k < KB; ++k) _mm256_store_ps(dots[h][k0 + k], a[h][k]);
    }
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) {
      __m256 v[8];
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) v[k] = _mm256_load_ps(dots[h][k]);
      _mm256_store_ps(scores[h] + 8 * half, sum8x8(v));
    }
  }
}

// Decode on AVX2: the `group` query heads of one KV head (queries `qv`, fp32 and scaled, D floats each)
// against `n` keys read in place (fp32, or bf16 widened as they load: no fp32 copy of the tile). fp32 scores go 8
// keys at a time per head (8 independent multiply-add chains sharing each query vector, summed across lanes
// together by `sum8x8`), bf16 ones by up to 4 heads at once (`score_keys_bf16`); the softmax runs on 8 lanes;
// values go by up to 4 heads at once (`accumulate_values_avx2`). Rows past n are the tile's last key again (see
// tile_kernel), their scores masked. `ahead` (the later tile's stream, see TilePrefetch) moves on a line per step
// over the dimensions of the first head's scores, and over the first heads' values by twice the lines each pass
// reads.
template <typename T, int D>
inline void attend_tile_avx2(int64_t group, const float* qv, const T* const* key_rows,
                             const T* const* value_rows, int64_t kv_offset, int n, float* maximum, float* sum,
                             float* acc, TilePrefetch* ahead) {
  alignas(32) float scores[MAX_GROUP][16];
  const int halves = n > 8 ? 2 : 1;
  if constexpr (std::is_same_v<T, bf16>) {  // each key widened once for up to 4 query heads
    for (int64_t g = 0; g < group;) {
      const int64_t heads = std::min<int64_t>(4, group - g);
      with_constant<4>(heads, [&](auto nh) {
        score_keys_bf16<D, decltype(nh)::value>(qv + g * D, key_rows, kv_offset, halves, scores + g,
                                                g == 0 ? ahead : nullptr);
      });
      g += heads;
    }
  } else {  // fp32 keys load as the multiply-adds' memory operands: nothing to share between heads
    for (int64_t g = 0; g < group; ++g) {
      const float* q = qv + g * D;
      for (int half = 0; half < halves; ++half) {
        const T* key[8];
        for (int i = 0; i < 8; ++i) key[i] = key_rows[8 * half + i] + kv_offset;
        __m256 dots[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) dots[i] = _mm256_mul_ps(_mm256_loadu_ps(q), load8(key[i]));
        for (int d = 8; d < D; d += 8) {
          if (g == 0) ahead->next(1);
          const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) dots[i] = _mm256_fmadd_ps(qd, load8(key[i] + d), dots[i]);
        }
        _mm256_store_ps(scores[g] + 8 * half, sum8x8(dots));
      }
    }
  }
  if (halves == 1)
    for (int64_t g = 0; g < group; ++g) _mm256_store_ps(scores[g] + 8, _mm256_setzero_ps());
  float alpha[MAX_GROUP];
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 valid_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  const __m256 valid_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), lanes));
  for (int64_t g = 0; g < group; ++g) {
    const __m256 x_lo = _mm256_blendv_ps(minus_inf, _mm256_load_ps(scores[g]), valid_lo);
    const __m256 x_hi = _mm256_blendv_ps(minus_inf, _mm256_load_ps(scores[g] + 8), valid_hi);
    const float m = std::max(maximum[g], reduce8(_mm256_max_ps(x_lo, x_hi), true));
    const __m256 mv = _mm256_set1_ps(m);
    const __m256 e_lo = _mm256_and_ps(valid_lo, exp_nonpositive8(_mm256_sub_ps(x_lo, mv)));
    const __m256 e_hi = _mm256_and_ps(valid_hi, exp_nonpositive8(_mm256_sub_ps(x_hi, mv)));
    _mm256_store_ps(scores[g], e_lo);
    _mm256_store_ps(scores[g] + 8, e_hi);
    alpha[g] = exp_nonpositive(maximum[g] - m);
    maximum[g] = m;
    sum[g] = sum[g] * alpha[g] + reduce8(_mm256_add_ps(e_lo, e_hi), false);
  }
  for (int64_t g = 0; g < group;) {
    const int64_t heads = std::min<int64_t>(4, group - g);
    with_constant<4>(heads, [&](auto nh) {
      accumulate_values_avx2<T, D, decltype(nh)::value>(value_rows, kv_offset, n, scores + g, alpha + g, acc + g * D,
                                                       g == 0 ? ahead : nullptr);
    });
    g += heads;
  }
}
#endif

// The query heads of one KV head, `NG_MAX` at a time (their accumulators must fit the 32 vector registers).
template <typename T, int D, bool BF16_DOT>
inline void attend_tile_group(int64_t group, const T* const* q_raw, const vf16* qv, const T* const* key_rows,
                              const T* const* value_rows, int64_t kv_offset, const vf16* kt, const vf16* vt, int n, float scale, float* maximum,
                              float* sum, vf16* acc, TilePrefetch* ahead) {
  constexpr int C = D / 16, NG_MAX = D == 64 ? 4 : 2;
#if defined(LLM_AVX2_ONLY)
  if constexpr (AVX2_READS_IN_PLACE<T>) {
    attend_tile_avx2<T, D>(group, reinterpret_cast<const float*>(qv), key_rows, value_rows, kv_offset, n, maximum, sum,
                        reinterpret_cast<float*>(acc), ahead);
    return;
  }
#endif
  for (int64_t g = 0; g < group; g += NG_MAX) {
    const int64_t count = std::min<int64_t>(NG_MAX, group - g);
    const T* const* qr = q_raw + g;
    const vf16* qg = qv + g * C;
    vf16* ag = acc + g * C;
    if (count == NG_MAX) {
      attend_tile<T, D, BF16_DOT, NG_MAX>(qr, qg, key_rows, value_rows, kv_offset, kt, vt, n, scale, maximum + g, sum + g, ag, g == 0 ? ahead : nullptr);
    } else if (count == 1) {
      attend_tile<T, D, BF16_DOT, 1>(qr, qg, key_rows, value_rows, kv_offset, kt, vt, n, scale, maximum + g, sum + g, ag, g == 0 ? ahead : nullptr);
    } else if constexpr (NG_MAX == 4) {
      if (count == 2) {
        attend_tile<T, D, BF16_DOT, 2>(qr, qg, key_rows, value_rows, kv_offset, kt, vt, n, scale, maximum + g, sum + g, ag, g == 0 ? ahead : nullptr);
      } else {
        attend_tile<T, D, BF16_DOT, 3>(qr, qg, key_rows, value_rows, kv_offset, kt, vt, n, scale, maximum + g, sum + g, ag, g == 0 ? ahead : nullptr);
      }
    }
  }
}

// The sequences' indices, longest first (ties in batch order).
inline std::vector<int32_t> longest_first(const int64_t* seq_lens, int64_t batch) {
  std::vector<int32_t> order(batch);
  for (int64_t i = 0; i < batch; ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return seq_lens[a] > seq_lens[b]; });
  return order;
}

// One task per (sequence, `heads_per_task` consecutive KV heads): with all of a sequence's KV heads in one task,
// each 16-token tile is read as contiguous rows (the cache interleaves heads per token), which the prefetchers
// follow, where one head per task would read every token's row in pieces.
// Threads take tasks one at a time, longest first, rather than fixed shares: as fast when the cores are free, and
// when another process takes a share of one core (as tritonserver's and the stub's response threads do) the other
// thread takes over its tasks instead of waiting for it at the barrier.
template <typename T, int D>
void tile_kernel(T* out, const T* q, int64_t q_row_stride, const T* key_cache, const T* value_cache,
                 const int64_t* block_tables, const int64_t* seq_lens, int64_t batch, int64_t num_heads,
                 int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale, int64_t heads_per_task) {
  constexpr int C = D / 16;
  constexpr bool BF16_DOT = HAVE_BF16_DOT && std::is_same_v<T, bf16>;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * D;
  const int64_t splits = num_kv_heads / heads_per_task;
  auto body = [&](auto next_task) {
    const int64_t max_heads = heads_per_task * group;
    std::vector<vf16> key_tiles(heads_per_task * 16 * C), value_tiles(heads_per_task * 16 * C);
    std::vector<vf16> qv(max_heads * C), acc(max_heads * C);
    std::vector<float> maxima(max_heads), sums(max_heads);
    // The next task is claimed as this one starts, so that this one's last tiles prefetch its first rows (as in
    // amx_decode_kernel).
    int64_t task = next_task();
    while (task >= 0) {
      const int64_t next = next_task();
      const int64_t seq = task / splits, first_kv = (task % splits) * heads_per_task;
      const int64_t first_head = first_kv * group, heads = heads_per_task * group;
      const int64_t seq_len = seq_lens[seq], tiles_len = (seq_len + 15) / 16 * 16;
      const int64_t* table = block_tables + seq * max_blocks;
      const T* q_raw[MAX_KV_HEADS * MAX_GROUP];
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = q + seq * q_row_stride + (first_head + h) * D;
        q_raw[h] = src;
        for (int c = 0; c < C; ++c) { qv[h * C + c] = load_vf16(src + 16 * c) * scale; acc[h * C + c] = vf16{}; }
        maxima[h] = -std::numeric_limits<float>::infinity();
        sums[h] = 0.f;
      }
      for (int64_t t0 = 0; t0 < seq_len; t0 += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, seq_len - t0));
        TilePrefetch ahead;
        ahead.lines_per_row = static_cast<int>((heads_per_task * D * sizeof(T) + 63) / 64);
        // The rows PREFETCH_TOKENS ahead: this task's, or past its end the next task's first ones.
        const bool own = t0 + PREFETCH_TOKENS < tiles_len;
        if (own || next >= 0) {
          const int64_t ahead_seq = own ? seq : next / splits;
          const int64_t ahead_kv = own ? first_kv : (next % splits) * heads_per_task;
          const int64_t first = own ? t0 + PREFETCH_TOKENS : t0 + PREFETCH_TOKENS - tiles_len;
          const int64_t stop = std::min<int64_t>(first + 16, seq_lens[ahead_seq]);
          const int64_t* ahead_table = block_tables + ahead_seq * max_blocks;
          int64_t pblk = first / block_size, poff = first % block_size;
          for (int64_t t = first; t < stop; ++t) {
            const int64_t row = (ahead_table[pblk] * block_size + poff) * row_stride + ahead_kv * D;
            if (++poff == block_size) { poff = 0; ++pblk; }
            ahead.keys[ahead.n] = reinterpret_cast<const char*>(key_cache + row);
            ahead.values[ahead.n++] = reinterpret_cast<const char*>(value_cache + row);
          }
        }
        int64_t blk = t0 / block_size, off = t0 % block_size;
        const T* key_rows[16];
        const T* value_rows[16];
        for (int i = 0; i < n; ++i) {  // the tile's keys and values of this task's KV heads, in fp32
          const int64_t row = (table[blk] * block_size + off) * row_stride + first_kv * D;
          if (++off == block_size) { off = 0; ++blk; }
          key_rows[i] = key_cache + row;
          value_rows[i] = value_cache + row;
          if constexpr (!BF16_DOT && !std::is_same_v<T, float> && !AVX2_READS_IN_PLACE<T>) {  // tiles in fp32
            for (int64_t kh = 0; kh < heads_per_task; ++kh)
              for (int c = 0; c < C; ++c) {
                key_tiles[(kh * 16 + i) * C + c] = load_vf16(key_cache + row + kh * D + 16 * c);
                value_tiles[(kh * 16 + i) * C + c] = load_vf16(value_cache + row + kh * D + 16 * c);
              }
          }
        }
        for (int i = n; i < 16; ++i) { key_rows[i] = key_rows[n - 1]; value_rows[i] = value_rows[n - 1]; }  // masked
        for (int64_t kh = 0; kh < heads_per_task; ++kh) {
          const int64_t h = kh * group;
          attend_tile_group<T, D, BF16_DOT>(group, q_raw + h, qv.data() + h * C, key_rows, value_rows, kh * D,
                                            key_tiles.data() + kh * 16 * C, value_tiles.data() + kh * 16 * C, n, scale,
                                            maxima.data() + h, sums.data() + h, acc.data() + h * C, &ahead);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* dst = out + (seq * num_heads + first_head + h) * D;
        const float inv = 1.f / sums[h];
        alignas(64) float tmp[D];
        for (int c = 0; c < C; ++c) store_vf16(tmp + 16 * c, acc[h * C + c] * inv);
        if constexpr (BF16_DOT) {  // accumulators 2c / 2c + 1: the even / odd dimensions of 32c..32c + 31
          for (int d = 0; d < D; ++d) dst[d] = from_float<T>(tmp[widened_index(d)]);
        } else {
          for (int d = 0; d < D; ++d) dst[d] = from_float<T>(tmp[d]);
        }
      }
      task = next;
    }
  };
  // Longest sequences first (see above).
  const int64_t num_tasks = batch * splits;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_tasks));
  const std::vector<int32_t> order = longest_first(seq_lens, batch);
  std::atomic<int64_t> taken{0};
  auto next_task = [&]() -> int64_t {
    const int64_t i = taken.fetch_add(1, std::memory_order_relaxed);
    return i < num_tasks ? order[i / splits] * splits + i % splits : -1;
  };
#pragma omp parallel num_threads(threads)
  body(next_task);
}

#if LLM_HAVE_AMX
// bf16 decode with the scores on AMX tiles. A 16-token tile of keys is one block's 16 rows, so an AMX A tile
// (16 rows x 32 dimensions) loads straight from the cache with the token stride; the task's query heads, scattered
// into B tiles once per task (k-step s: the 32 dimensions of KV head s / (D / 32) it covers, zero in the columns
// of the other KV heads' query heads), make every k-step add into one 16 x 16 tile of scores: row = key, column =
// query head. So the softmax runs with one lane per query head (maxima and sums down the rows, no horizontal
// reductions), and P x V takes each probability as a scalar from the stored rows. Two score tiles take alternate
// k-steps, so that consecutive tile multiplications do not wait on each other.
constexpr int AMX_MAX_STEPS = 16;  // k-steps per task: B tiles kept per task (16 KiB)

template <int D>
inline void amx_scores(const bf16* keys, int64_t stride_bytes, const bf16* qtiles, int steps, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  int k = 0;
  for (; k + 1 < steps; k += 2) {
    _tile_loadd(2, keys + 32 * k, stride_bytes);
    _tile_loadd(4, qtiles + 512 * k, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_loadd(3, keys + 32 * (k + 1), stride_bytes);
    _tile_loadd(5, qtiles + 512 * (k + 1), 64);
    _tile_dpbf16ps(1, 3, 5);
  }
  if (k < steps) {
    _tile_loadd(2, keys + 32 * k, stride_bytes);
    _tile_loadd(4, qtiles + 512 * k, 64);
    _tile_dpbf16ps(0, 2, 4);
  }
  _tile_stored(0, s, 64);
  _tile_stored(1, s + 256, 64);
}

// The online softmax of one 16 x 16 score tile (`scores`: the two k-step halves of `amx_scores`), one lane per
// score-tile column: rows are keys (the first n), columns query vectors. `valid[r]` (MASKED only) marks the columns
// that may see key r; the others get a probability of exactly 0 and, where no key of the tile is theirs, keep their
// maximum (rescale 1). Writes p (n rows of 16) and alpha (the rescale of the accumulators) and advances maxima
// and sums. A column must have seen a key before (or in) its first tile, so that its maximum is finite (the
// prefill's unused padding columns see none; their results are never written).
template <bool MASKED>
inline void amx_column_softmax(const float* scores, int n, float scale, const __mmask16* valid, __m512& maxima,
                               __m512& sums, float* p, float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 rows[16];
  __m512 tile_max = neg_inf;
  for (int r = 0; r < n; ++r) {
    rows[r] = _mm512_mul_ps(_mm512_add_ps(_mm512_load_ps(scores + 16 * r), _mm512_load_ps(scores + 256 + 16 * r)),
                            _mm512_set1_ps(scale));
    if constexpr (MASKED) rows[r] = _mm512_mask_mov_ps(neg_inf, valid[r], rows[r]);
    tile_max = _mm512_max_ps(tile_max, rows[r]);
  }
  const __m512 m = _mm512_max_ps(maxima, tile_max);
  const __m512 rescale = exp_nonpositive16(_mm512_sub_ps(maxima, m));
  __m512 tile_sum = _mm512_setzero_ps();
  for (int r = 0; r < n; ++r) {
    __m512 e = exp_nonpositive16(_mm512_sub_ps(rows[r], m));
    if constexpr (MASKED) e = _mm512_maskz_mov_ps(valid[r], e);
    tile_sum = _mm512_add_ps(tile_sum, e);
    _mm512_store_ps(p + 16 * r, e);
  }
  maxima = m;
  sums = _mm512_fmadd_ps(sums, rescale, tile_sum);
  _mm512_store_ps(alpha, rescale);
}

// P x V for `NG` query heads of one KV head: acc (NG x C vectors, even / odd dimensions as in attend_tile) scaled by
// alpha, then += p[i][col0 + g] * v_i for the tile's n tokens.
template <int D, int NG>
inline void amx_pv(const bf16* const* value_rows, int64_t kv_offset, const float* p, const float* alpha, int col0,
                   int n, vf16* acc) {
  constexpr int C = D / 16;
  vf16 a[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = acc[g * C + c] * alpha[col0 + g];
  for (int i = 0; i < n; ++i) accumulate_value_row<D, NG>(value_rows[i] + kv_offset, p + 16 * i + col0, 1, a);
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) acc[g * C + c] = a[g][c];
}

template <int D>
inline void amx_pv_group(int64_t group, const bf16* const* value_rows, int64_t kv_offset, const float* p,
                         const float* alpha, int col0, int n, vf16* acc) {
  constexpr int C = D / 16, NG_MAX = D == 64 ? 4 : 2;
  for (int64_t g = 0; g < group; g += NG_MAX) {
    const int count = static_cast<int>(std::min<int64_t>(NG_MAX, group - g));
    const int col = col0 + static_cast<int>(g);
    vf16* ag = acc + g * C;
    if (count == NG_MAX) amx_pv<D, NG_MAX>(value_rows, kv_offset, p, alpha, col, n, ag);
    else if (count == 1) amx_pv<D, 1>(value_rows, kv_offset, p, alpha, col, n, ag);
    else if constexpr (NG_MAX == 4) {
      if (count == 2) amx_pv<D, 2>(value_rows, kv_offset, p, alpha, col, n, ag);
      else amx_pv<D, 3>(value_rows, kv_offset, p, alpha, col, n, ag);
    }
  }
}

// The keys and values of tokens [first, min(first + 16, len)) of a task (`row_bytes` of each token's rows from
// element `kv_offset`: its KV heads) into L2, with `prefetch_t2` (with __builtin_prefetch here GCC 12 dropped every
// one of them, and the kernel took 1.4x the time).
inline void prefetch_kv_rows(const bf16* key_cache, const bf16* value_cache, const int64_t* table, int64_t block_size,
                             int64_t row_stride, int64_t kv_offset, int64_t row_bytes, int64_t first, int64_t len) {
  for (int64_t t = first, stop = std::min<int64_t>(first + 16, len); t < stop; ++t) {
    const int64_t row = (table[t / block_size] * block_size + t % block_size) * row_stride + kv_offset;
    const char* kp = reinterpret_cast<const char*>(key_cache + row);
    const char* vp = reinterpret_cast<const char*>(value_cache + row);
    for (int64_t b = 0; b < row_bytes; b += 64) { prefetch_t2(kp + b); prefetch_t2(vp + b); }
  }
}

// The tasks of `tile_kernel` (sequence x heads_per_task KV heads, longest sequences first); heads_per_task x group
// <= 16 query heads (the score tile's columns), heads_per_task x D / 32 <= AMX_MAX_STEPS, block_size % 16 == 0.
template <int D>
void amx_decode_kernel(bf16* out, const bf16* q, int64_t q_row_stride, const bf16* key_cache,
                       const bf16* value_cache, const int64_t* block_tables, const int64_t* seq_lens, int64_t batch,
                       int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale,
                       int64_t heads_per_task) {
  constexpr int C = D / 16;
  const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * D;
  const int64_t splits = num_kv_heads / heads_per_task, heads = heads_per_task * group;
  const int steps = static_cast<int>(heads_per_task * (D / 32));
  const int64_t stride_bytes = row_stride * static_cast<int64_t>(sizeof(bf16));
  const int64_t num_tasks = batch * splits;
  std::vector<int32_t> order = longest_first(seq_lens, batch);
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_tasks)))
  {
    TileConfig config;
    for (int t = 0; t < 6; ++t) { config.rows[t] = 16; config.colsb[t] = 64; }
    _tile_loadconfig(&config);
    alignas(64) uint32_t qtiles[AMX_MAX_STEPS * 256];  // B tiles: [step][16 dimension pairs][16 query heads]
    alignas(64) float scores[2][512], p[256], alpha[16];
    std::vector<vf16> acc(16 * C);
    // A thread claims its next task as it starts one, so that this task's last tiles prefetch the next one's first
    // rows; else the first PREFETCH_TOKENS tokens of every task are read with nothing in flight ahead of them.
    int64_t i = taken.fetch_add(1, std::memory_order_relaxed);
    while (i < num_tasks) {
      const int64_t next = taken.fetch_add(1, std::memory_order_relaxed);
      const int64_t seq = order[i / splits], first_kv = (i % splits) * heads_per_task;
      const int64_t seq_len = seq_lens[seq], tiles_len = (seq_len + 15) / 16 * 16;
      const int64_t* table = block_tables + seq * max_blocks;
      const bf16* q_heads = q + seq * q_row_stride + first_kv * group * D;
      const bool has_next = next < num_tasks;
      const int64_t next_seq = has_next ? order[next / splits] : 0, next_kv = (next % splits) * heads_per_task;
      const int64_t next_len = has_next ? seq_lens[next_seq] : 0;
      const int64_t* next_table = block_tables + next_seq * max_blocks;
      std::memset(qtiles, 0, sizeof(uint32_t) * 256 * steps);
      for (int64_t h = 0; h < heads; ++h) {  // query head h: column h of the steps of its KV head
        const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q_heads + h * D);
        const int64_t first_step = (h / group) * (D / 32);
        for (int c = 0; c < D / 32; ++c)
          for (int r = 0; r < 16; ++r) qtiles[(first_step + c) * 256 + r * 16 + h] = pairs[16 * c + r];
      }
      __m512 maxima = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sums = _mm512_setzero_ps();
      std::fill(acc.begin(), acc.begin() + heads * C, vf16{});
      const int64_t row_bytes = heads_per_task * D * static_cast<int64_t>(sizeof(bf16));
      // A tile's scores are computed one tile ahead: the tile unit works on them while the vector units do the
      // softmax and P x V of the tile before (the tile unit's results would otherwise be waited for).
      auto tile_row = [&](int64_t t) { return (table[t / block_size] * block_size + t % block_size) * row_stride + first_kv * D; };
      amx_scores<D>(key_cache + tile_row(0), stride_bytes, reinterpret_cast<const bf16*>(qtiles), steps, scores[0]);
      for (int64_t t0 = 0; t0 < seq_len; t0 += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, seq_len - t0));
        const float* tile_scores = scores[(t0 / 16) % 2];
        if (t0 + 16 < seq_len)
          amx_scores<D>(key_cache + tile_row(t0 + 16), stride_bytes, reinterpret_cast<const bf16*>(qtiles), steps,
                        scores[(t0 / 16 + 1) % 2]);
        if (t0 + PREFETCH_TOKENS < tiles_len)
          prefetch_kv_rows(key_cache, value_cache, table, block_size, row_stride, first_kv * D, row_bytes,
                           t0 + PREFETCH_TOKENS, seq_len);
        else if (has_next)  // past this task's rows: the next task's first ones
          prefetch_kv_rows(key_cache, value_cache, next_table, block_size, row_stride, next_kv * D, row_bytes,
                           t0 + PREFETCH_TOKENS - tiles_len, next_len);
        if (t0 == 0 && tiles_len == 16 && has_next)  // a one-tile task: the next one's first tile too
          prefetch_kv_rows(key_cache, value_cache, next_table, block_size, row_stride, next_kv * D, row_bytes, 0,
                           next_len);
        const int64_t first_row = tile_row(t0);
        amx_column_softmax<false>(tile_scores, n, scale, nullptr, maxima, sums, p, alpha);  // one lane per query head
        const bf16* value_rows[16];
        for (int r = 0; r < n; ++r) value_rows[r] = value_cache + first_row + r * row_stride;
        for (int64_t kh = 0; kh < heads_per_task; ++kh)
          amx_pv_group<D>(group, value_rows, kh * D, p, alpha, static_cast<int>(kh * group), n,
                          acc.data() + kh * group * C);
      }
      alignas(64) float inv[16];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sums));
      for (int64_t h = 0; h < heads; ++h) {
        bf16* dst = out + (seq * num_heads + first_kv * group + h) * D;
        alignas(64) float tmp[D];
        for (int c = 0; c < C; ++c) store_vf16(tmp + 16 * c, acc[h * C + c] * inv[h]);
        for (int d = 0; d < D; ++d) dst[d] = from_float<bf16>(tmp[widened_index(d)]);
      }
      i = next;
    }
    _tile_release();
  }
}
#endif

// Prefill (several query rows per sequence, causal), reading the blocks in place as decode does: one task per
// (sequence, KV head, `QUERY_ROWS` consecutive query rows); each 16-token tile of keys and values is loaded once,
// in fp32, for all of the task's rows and query heads (the keys transposed, so that a query's 16 scores come out
// as one vector with no horizontal sums), and row r (position seq_len - q_len + r) stops at its own position.
// Queries go by `VECTORS` at a time, their multiply-adds independent: a small register-blocked GEMM per tile.
constexpr int64_t QUERY_ROWS = 16;
#if defined(LLM_AVX2_ONLY)
constexpr int VECTORS = 6;  // 12 of AVX2's 16 registers: 6 vectors x 16 scores, or x 16 dimensions of values
#else
constexpr int VECTORS = 4;
#endif

// dst[j][i] = src[i * stride + j] for a 16 x 16 block of floats (dst: 16 rows of 16, contiguous): with AVX-512,
// four rounds of shuffles across the 16 vectors instead of 256 scalar moves; with AVX2, three per 8 x 8 block.
inline void transpose16(const float* src, int64_t stride, float* dst) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * stride);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(dst + 16 * i, _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88));
    _mm512_storeu_ps(dst + 16 * (8 + i), _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd));
  }
#elif defined(__AVX2__)
  for (int bi = 0; bi < 16; bi += 8)  // four 8 x 8 blocks, three rounds of shuffles each
    for (int bj = 0; bj < 16; bj += 8) {
      const float* s = src + bi * stride + bj;
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + i * stride);
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 2; ++i) {
        r[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      float* d = dst + 16 * bj + bi;
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(d + 16 * i, _mm256_permute2f128_ps(r[i], r[4 + i], 0x20));
        _mm256_storeu_ps(d + 16 * (4 + i), _mm256_permute2f128_ps(r[i], r[4 + i], 0x31));
      }
    }
#else
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) dst[16 * j + i] = src[i * stride + j];
#endif
}

// Online softmax over one tile for `count` query vectors: scores s[j] (16 lanes, lanes >= n[j] masked) update
// maxima / sums and become the probabilities p[j]; returns each vector's rescaling of its accumulator in alpha.
inline void softmax_tile(const vf16* s, const int* n, int count, float* maxima, float* sums, float* p, float* alpha) {
  for (int j = 0; j < count; ++j) {
    alignas(64) float row[16];
    store_vf16(row, s[j]);
    float m = maxima[j];
#if defined(__AVX512F__)
    const __mmask16 valid = static_cast<__mmask16>(n[j] >= 16 ? 0xFFFFu : (1u << n[j]) - 1u);
    const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                        _mm512_load_ps(row));
    m = std::max(m, _mm512_reduce_max_ps(x));
    const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive16(_mm512_sub_ps(x, _mm512_set1_ps(m))));
    _mm512_store_ps(p + 16 * j, e);
    const float tile_sum = _mm512_reduce_add_ps(e);
#else
    for (int i = 0; i < n[j]; ++i) m = std::max(m, row[i]);
    float tile_sum = 0.f;
    for (int i = 0; i < 16; ++i) {
      p[16 * j + i] = i < n[j] ? exp_nonpositive(row[i] - m) : 0.f;
      tile_sum += p[16 * j + i];
    }
#endif
    alpha[j] = exp_nonpositive(maxima[j] - m);
    maxima[j] = m;
    sums[j] = sums[j] * alpha[j] + tile_sum;
  }
}

#if defined(LLM_AVX2_ONLY)
// The AVX2 form of the block below, written with 8-lane intrinsics (GCC lowers the 16-float vector type to pairs of
// AVX2 registers through the stack, about ten times slower). Both products are 6 x 16 register blocks, the shape of
// BLIS's Haswell sgemm kernel (Van Zee & van de Geijn, ACM TOMS 2015): the scores of 6 query vectors against the
// tile's 16 keys (two registers per vector, a broadcast of q[j][d] against the transposed keys' dimension d), then
// the values 16 dimensions at a time (two registers per vector, p[j][i] broadcast against value row i): 12
// independent multiply-add chains, two vector loads and 6 broadcasts per 12 multiply-adds. Each output's sum runs
// over d, and over the keys, in order.
template <int D>
inline void attend_tile_block(const float* q, const vf16* kt, const vf16* vt, const int* n, int count,
                              float* maxima, float* sums, vf16* acc) {
  const float* ktf = reinterpret_cast<const float*>(kt);  // kt[d]: the tile's 16 keys' dimension d
  const float* vtf = reinterpret_cast<const float*>(vt);  // row i: value i, D floats
  float* accf = reinterpret_cast<float*>(acc);            // vector j: D floats
  __m256 lo[VECTORS], hi[VECTORS];
#pragma GCC unroll 6
  for (int j = 0; j < VECTORS; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {  // vectors past `count` (an earlier task's queries, or zeros): computed, not used
    const __m256 k_lo = _mm256_loadu_ps(ktf + 16 * d), k_hi = _mm256_loadu_ps(ktf + 16 * d + 8);
#pragma GCC unroll 6
    for (int j = 0; j < VECTORS; ++j) {
      const __m256 qb = _mm256_broadcast_ss(q + j * D + d);
      lo[j] = _mm256_fmadd_ps(qb, k_lo, lo[j]);
      hi[j] = _mm256_fmadd_ps(qb, k_hi, hi[j]);
    }
  }
  // Stored once here, and every loop over the vectors that indexes a register array unrolled: else GCC keeps
  // the accumulators in memory, a store per multiply-add.
  alignas(64) float scores[VECTORS * 16], p[VECTORS * 16] = {};
#pragma GCC unroll 6
  for (int j = 0; j < VECTORS; ++j) {
    _mm256_store_ps(scores + 16 * j, lo[j]);
    _mm256_store_ps(scores + 16 * j + 8, hi[j]);
  }
  float alpha[VECTORS] = {};
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int keys = 0;
  for (int j = 0; j < count; ++j) {
    const __m256i nn = _mm256_set1_epi32(n[j]);
    const __m256 valid_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nn, lanes));
    const __m256 valid_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nn, _mm256_add_epi32(lanes, _mm256_set1_epi32(8))));
    const __m256 x_lo = _mm256_blendv_ps(minus_inf, _mm256_load_ps(scores + 16 * j), valid_lo);
    const __m256 x_hi = _mm256_blendv_ps(minus_inf, _mm256_load_ps(scores + 16 * j + 8), valid_hi);
    const float m = std::max(maxima[j], reduce8(_mm256_max_ps(x_lo, x_hi), true));
    const __m256 mv = _mm256_set1_ps(m);
    const __m256 e_lo = _mm256_and_ps(valid_lo, exp_nonpositive8(_mm256_sub_ps(x_lo, mv)));
    const __m256 e_hi = _mm256_and_ps(valid_hi, exp_nonpositive8(_mm256_sub_ps(x_hi, mv)));
    _mm256_store_ps(p + 16 * j, e_lo);
    _mm256_store_ps(p + 16 * j + 8, e_hi);
    alpha[j] = exp_nonpositive(maxima[j] - m);
    maxima[j] = m;
    sums[j] = sums[j] * alpha[j] + reduce8(_mm256_add_ps(e_lo, e_hi), false);
    keys = std::max(keys, n[j]);
  }
  for (int c0 = 0; c0 < D; c0 += 16) {
    __m256 a[VECTORS][2];
#pragma GCC unroll 6
    for (int j = 0; j < VECTORS; ++j) {
      const __m256 scale = _mm256_set1_ps(alpha[j]);
      a[j][0] = j < count ? _mm256_mul_ps(_mm256_loadu_ps(accf + j * D + c0), scale) : _mm256_setzero_ps();
      a[j][1] = j < count ? _mm256_mul_ps(_mm256_loadu_ps(accf + j * D + c0 + 8), scale) : _mm256_setzero_ps();
    }
    for (int i = 0; i < keys; ++i) {
      const __m256 v0 = _mm256_loadu_ps(vtf + i * D + c0), v1 = _mm256_loadu_ps(vtf + i * D + c0 + 8);
#pragma GCC unroll 6
      for (int j = 0; j < VECTORS; ++j) {
        const __m256 pb = _mm256_broadcast_ss(p + 16 * j + i);
        a[j][0] = _mm256_fmadd_ps(pb, v0, a[j][0]);
        a[j][1] = _mm256_fmadd_ps(pb, v1, a[j][1]);
      }
    }
#pragma GCC unroll 6
    for (int j = 0; j < VECTORS; ++j) {
      if (j < count) {
        _mm256_storeu_ps(accf + j * D + c0, a[j][0]);
        _mm256_storeu_ps(accf + j * D + c0 + 8, a[j][1]);
      }
    }
  }
}
#else
// `count` (<= VECTORS) query vectors q (fp32, scaled, D floats each) against a tile: keys transposed kt[d] (16
// lanes: the tile's keys), values vt[i * C + c] (rows past the tile's end are zero).
template <int D>
inline void attend_tile_block(const float* q, const vf16* kt, const vf16* vt, const int* n, int count,
                              float* maxima, float* sums, vf16* acc) {
  constexpr int C = D / 16;
  vf16 even[VECTORS] = {}, odd[VECTORS] = {};
  for (int d = 0; d < D; d += 2) {
    for (int j = 0; j < VECTORS; ++j) {
      even[j] += q[j * D + d] * kt[d];
      odd[j] += q[j * D + d + 1] * kt[d + 1];
    }
  }
  vf16 s[VECTORS];
  for (int j = 0; j < VECTORS; ++j) s[j] = even[j] + odd[j];
  alignas(64) float p[VECTORS * 16];
  float alpha[VECTORS];
  softmax_tile(s, n, count, maxima, sums, p, alpha);
  for (int j = count; j < VECTORS; ++j) store_vf16(p + 16 * j, vf16{});
  vf16 a[VECTORS][C];
  for (int j = 0; j < VECTORS; ++j)
    for (int c = 0; c < C; ++c) a[j][c] = j < count ? acc[j * C + c] * alpha[j] : vf16{};
  int keys = 0;
  for (int j = 0; j < count; ++j) keys = std::max(keys, n[j]);
  for (int i = 0; i < keys; ++i)
    for (int j = 0; j < VECTORS; ++j)
      for (int c = 0; c < C; ++c) a[j][c] += p[16 * j + i] * vt[i * C + c];
  for (int j = 0; j < count; ++j)
    for (int c = 0; c < C; ++c) acc[j * C + c] = a[j][c];
}
#endif

// src[0..D) in fp32 at dst (bf16 widened exactly): with AVX2, in 8-lane registers (GCC moves the 16-float vector
// type through 16-byte halves there).
template <int D, typename T>
inline void row_to_fp32(const T* src, float* dst) {
#if defined(LLM_AVX2_ONLY)
  for (int c = 0; c < D; c += 8) {
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(dst + c, _mm256_loadu_ps(src + c));
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
      _mm256_storeu_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
#else
  for (int c = 0; c < D; c += 16) store_vf16(dst + c, load_vf16(src + c));
#endif
}

template <typename T, int D>
void prefill_tile_kernel(T* out, const T* q, int64_t q_row_stride, const T* key_cache, const T* value_cache,
                         const int64_t* block_tables, const int64_t* cu_seqlens, const int64_t* seq_lens,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                         int64_t max_blocks, float scale) {
  constexpr int C = D / 16;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * D;
  std::vector<int64_t> first_task(num_seqs + 1, 0);  // tasks of sequence p: [first_task[p], first_task[p + 1])
  for (int64_t p = 0; p < num_seqs; ++p) {
    const int64_t q_len = cu_seqlens[p + 1] - cu_seqlens[p];
    first_task[p + 1] = first_task[p] + num_kv_heads * ((q_len + QUERY_ROWS - 1) / QUERY_ROWS);
  }
  // Tasks differ in cost (a prompt's last rows see all of it): handed out one at a time, not split in halves.
  const int64_t num_tasks = first_task[num_seqs];
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_tasks)))
  {
    const int64_t max_vectors = QUERY_ROWS * group + VECTORS;  // room for a last, partial block of vectors
    std::vector<vf16> key_tile(D), value_tile(16 * C), acc(max_vectors * C);
    std::vector<float> qf(max_vectors * D, 0.f), maxima(max_vectors), sums(max_vectors);
    std::vector<int> valid(max_vectors);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t p = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t q_len = cu_seqlens[p + 1] - cu_seqlens[p], seq_len = seq_lens[p];
      const int64_t row_blocks = (q_len + QUERY_ROWS - 1) / QUERY_ROWS;
      const int64_t kv_head = (task - first_task[p]) / row_blocks;
      const int64_t r0 = (task - first_task[p]) % row_blocks * QUERY_ROWS;
      const int64_t r1 = std::min(q_len, r0 + QUERY_ROWS), past = seq_len - q_len;
      const int64_t* table = block_tables + p * max_blocks;
      const T* q_rows = q + cu_seqlens[p] * q_row_stride;
      const int64_t vectors = (r1 - r0) * group;  // vector v: row r0 + v / group, query head kv_head * group + v % group
      for (int64_t v = 0; v < vectors; ++v) {
        const T* src = q_rows + (r0 + v / group) * q_row_stride + (kv_head * group + v % group) * D;
        for (int d = 0; d < D; ++d) qf[v * D + d] = to_float(src[d]) * scale;
        for (int c = 0; c < C; ++c) acc[v * C + c] = vf16{};
        maxima[v] = -std::numeric_limits<float>::infinity();
        sums[v] = 0.f;
      }
      const int64_t keys = past + r1;  // the last row's position + 1
      for (int64_t t0 = 0, blk = 0, off = 0; t0 < keys; t0 += 16) {  // token t0 + i at offset off of block blk
        const int tile = static_cast<int>(std::min<int64_t>(16, keys - t0));
        alignas(64) float keys_fp32[16][D];  // the tile's keys in fp32, one row per token, then transposed
        for (int i = 0; i < 16; ++i) {
          if (i < tile) {
            const int64_t row = (table[blk] * block_size + off) * row_stride + kv_head * D;
            if (++off == block_size) off = 0, ++blk;
            row_to_fp32<D>(key_cache + row, keys_fp32[i]);
            row_to_fp32<D>(value_cache + row, reinterpret_cast<float*>(value_tile.data() + i * C));
          } else {
            for (int c = 0; c < C; ++c) store_vf16(keys_fp32[i] + 16 * c, vf16{});
            for (int c = 0; c < C; ++c) value_tile[i * C + c] = vf16{};
          }
        }
        for (int c = 0; c < C; ++c)
          transpose16(keys_fp32[0] + 16 * c, D, reinterpret_cast<float*>(key_tile.data() + 16 * c));
        // rows whose position reaches this tile, and how many of its keys each sees
        const int64_t first_row = std::max(r0, t0 - past);
        for (int64_t v = (first_row - r0) * group; v < vectors; ++v)
          valid[v] = static_cast<int>(std::min<int64_t>(tile, past + r0 + v / group - t0 + 1));
        for (int64_t v = (first_row - r0) * group; v < vectors; v += VECTORS) {
          const int count = static_cast<int>(std::min<int64_t>(VECTORS, vectors - v));
          attend_tile_block<D>(qf.data() + v * D, key_tile.data(), value_tile.data(), valid.data() + v, count,
                               maxima.data() + v, sums.data() + v, acc.data() + v * C);
        }
      }
      T* out_rows = out + cu_seqlens[p] * num_heads * D;
      for (int64_t v = 0; v < vectors; ++v) {
        T* dst = out_rows + ((r0 + v / group) * num_heads + kv_head * group + v % group) * D;
        const float inv = 1.f / sums[v];
        alignas(64) float tmp[D];
        for (int c = 0; c < C; ++c) store_vf16(tmp + 16 * c, acc[v * C + c] * inv);
        for (int d = 0; d < D; ++d) dst[d] = from_float<T>(tmp[d]);
      }
    }
  }
}
#if LLM_HAVE_AMX
// bf16 prefill with the scores on AMX tiles, as `amx_decode_kernel` does for decode: a task is one sequence's KV
// head and 16 of its query vectors (vector v: query row v / group, head v % group of the KV head), the score
// tile's 16 columns; each 16-token tile of keys is loaded as an A tile straight from its block, and the causal
// limit is a per-column mask (column v sees keys up to its row's position). Against `prefill_tile_kernel` on
// SmolLM2's shapes (2 threads) this takes a quarter of the time off short prompts and over 40% off 300-token ones.
template <int D>
void amx_prefill_kernel(bf16* out, const bf16* q, int64_t q_row_stride, const bf16* key_cache,
                        const bf16* value_cache, const int64_t* block_tables, const int64_t* cu_seqlens,
                        const int64_t* seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                        int64_t block_size, int64_t max_blocks, float scale) {
  constexpr int C = D / 16, STEPS = D / 32;
  const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * D;
  const int64_t stride_bytes = row_stride * static_cast<int64_t>(sizeof(bf16));
  std::vector<int64_t> first_task(num_seqs + 1, 0);  // tasks of sequence p: [first_task[p], first_task[p + 1])
  for (int64_t p = 0; p < num_seqs; ++p) {
    const int64_t q_len = cu_seqlens[p + 1] - cu_seqlens[p];
    first_task[p + 1] = first_task[p] + num_kv_heads * ((q_len * group + 15) / 16);
  }
  const int64_t num_tasks = first_task[num_seqs];
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), num_tasks)))
  {
    TileConfig config;
    for (int t = 0; t < 6; ++t) { config.rows[t] = 16; config.colsb[t] = 64; }
    _tile_loadconfig(&config);
    alignas(64) uint32_t qtiles[STEPS * 256];
    alignas(64) float scores[512], p[256], alpha[16];
    alignas(64) int32_t limits[16];
    vf16 acc[16 * C];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const int64_t s = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
      const int64_t q_len = cu_seqlens[s + 1] - cu_seqlens[s], past = seq_lens[s] - q_len;
      const int64_t chunks = (q_len * group + 15) / 16;
      const int64_t kv_head = (task - first_task[s]) / chunks, v0 = (task - first_task[s]) % chunks * 16;
      const int count = static_cast<int>(std::min<int64_t>(16, q_len * group - v0));
      const int64_t* table = block_tables + s * max_blocks;
      const bf16* q_rows = q + cu_seqlens[s] * q_row_stride + kv_head * group * D;
      std::memset(qtiles, 0, sizeof(qtiles));
      int64_t keys = 0;
      for (int col = 0; col < 16; ++col) {
        if (col >= count) { limits[col] = 0; continue; }
        const int64_t v = v0 + col, row = v / group;
        const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q_rows + row * q_row_stride + (v % group) * D);
        for (int c = 0; c < STEPS; ++c)
          for (int r = 0; r < 16; ++r) qtiles[c * 256 + r * 16 + col] = pairs[16 * c + r];
        limits[col] = static_cast<int32_t>(past + row + 1);
        keys = std::max<int64_t>(keys, past + row + 1);
      }
      const __m512i limit = _mm512_load_si512(limits);
      __m512 maxima = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sums = _mm512_setzero_ps();
      for (int i = 0; i < 16 * C; ++i) acc[i] = vf16{};
      for (int64_t t0 = 0; t0 < keys; t0 += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, keys - t0));
        const int64_t first_row = (table[t0 / block_size] * block_size + t0 % block_size) * row_stride + kv_head * D;
        amx_scores<D>(key_cache + first_row, stride_bytes, reinterpret_cast<const bf16*>(qtiles), STEPS, scores);
        __mmask16 valid[16];  // the causal limit; every column sees key 0, so its maximum is finite from tile one
        for (int r = 0; r < n; ++r) valid[r] = _mm512_cmpgt_epi32_mask(limit, _mm512_set1_epi32(static_cast<int>(t0 + r)));
        amx_column_softmax<true>(scores, n, scale, valid, maxima, sums, p, alpha);
        const bf16* value_rows[16];
        for (int r = 0; r < n; ++r) value_rows[r] = value_cache + first_row + r * row_stride;
        amx_pv_group<D>(count, value_rows, 0, p, alpha, 0, n, acc);
      }
      alignas(64) float inv[16];
      _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), sums));
      bf16* out_rows = out + cu_seqlens[s] * num_heads * D;
      for (int col = 0; col < count; ++col) {
        const int64_t v = v0 + col;
        bf16* dst = out_rows + ((v / group) * num_heads + kv_head * group + v % group) * D;
        alignas(64) float tmp[D];
        for (int c = 0; c < C; ++c) store_vf16(tmp + 16 * c, acc[col * C + c] * inv[col]);
        for (int d = 0; d < D; ++d) dst[d] = from_float<bf16>(tmp[widened_index(d)]);
      }
    }
    _tile_release();
  }
}
#endif
}  // namespace
}  // namespace llm_cpu

namespace {
// What both kernels read through, checked before any is read (a bad table would read out of bounds, not raise):
// value_cache the key cache's shape and dtype; one block table row and one seq_len per sequence; each seq_len within
// its row (0..max_blocks * block_size) and the blocks that hold its keys (the row's first ceil(seq_len /
// block_size) entries) within the cache. Entries past those are not read (padding, e.g. -1). O(batch x blocks).
void check_paged_inputs(const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens, int64_t num_seqs) {
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == key_cache.scalar_type(),
              "value_cache must have key_cache's shape and dtype");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && seq_lens.dim() == 1
              && seq_lens.size(0) == num_seqs, "block_tables [", num_seqs, ", max_blocks] and seq_lens [", num_seqs,
              "]: one row and one length per sequence");
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(lens[i] >= 0 && lens[i] <= max_blocks * block_size, "seq_lens[", i, "] = ", lens[i],
                " is outside 0..", max_blocks * block_size, " (the block table's ", max_blocks, " blocks of ",
                block_size, ")");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[i * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", i, "][", b, "] = ", block,
                  " is not a block of the cache (0..", num_blocks - 1, ")");
    }
  }
}
}  // namespace

// out, q: [batch, num_heads, head_dim], out contiguous, q with each row's heads contiguous and any row stride (a
// view of the fused QKV output will do); key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [batch, max_blocks] int64; seq_lens: [batch] int64 (keys 0..seq_len-1 are attended).
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: [rows, num_heads, head_dim], each row's heads contiguous");
  TORCH_CHECK(out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous()
              && block_tables.is_contiguous() && seq_lens.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && q.scalar_type() == key_cache.scalar_type()
              && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "q, out [batch, heads, head_dim] and caches [blocks, block_size, kv_heads, head_dim] of one dtype");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes do not match");
  check_paged_inputs(key_cache, value_cache, block_tables, seq_lens, batch);
  llm_cpu::dispatch_float_types(q.scalar_type(), "paged_decode_attention", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = reinterpret_cast<T*>(out.data_ptr());
    const T* qs = reinterpret_cast<const T*>(q.data_ptr());
    const int64_t q_row_stride = q.stride(0);
    const T* kc = reinterpret_cast<const T*>(key_cache.data_ptr());
    const T* vc = reinterpret_cast<const T*>(value_cache.data_ptr());
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t max_blocks = block_tables.size(1);
    const float s = static_cast<float>(scale);
    constexpr bool vectorized = std::is_same_v<T, float> || std::is_same_v<T, llm_cpu::bf16>;
    const bool tiled = vectorized && num_heads / num_kv_heads <= llm_cpu::MAX_GROUP;
    // All of a sequence's KV heads in one task when the batch alone keeps every thread busy; else one each.
    int64_t heads_per_task = 1;
    if (batch >= 4 * at::get_num_threads()) {
      for (int64_t h = std::min(num_kv_heads, llm_cpu::MAX_KV_HEADS); h >= 1; --h) {
        if (num_kv_heads % h == 0) { heads_per_task = h; break; }
      }
    }
#if LLM_HAVE_AMX
    if constexpr (std::is_same_v<T, llm_cpu::bf16>) {
      // AMX scores: the task's query heads fit the score tile's 16 columns, its k-steps the B tiles kept.
      int64_t amx_heads = heads_per_task;
      while (amx_heads > 1 && (amx_heads * (num_heads / num_kv_heads) > 16 || amx_heads * head_dim / 32 > llm_cpu::AMX_MAX_STEPS
                               || num_kv_heads % amx_heads))
        --amx_heads;
      if ((head_dim == 64 || head_dim == 128) && block_size % 16 == 0 && num_heads / num_kv_heads <= 16
          && llm_cpu::amx_usable()) {
        const auto run = head_dim == 64 ? llm_cpu::amx_decode_kernel<64> : llm_cpu::amx_decode_kernel<128>;
        return run(o, qs, q_row_stride, kc, vc, tables, lens, batch, num_heads, num_kv_heads, block_size, max_blocks,
                   s, amx_heads);
      }
    }
#endif
    if constexpr (vectorized) {
      if (tiled && head_dim == 64) {
        return llm_cpu::tile_kernel<T, 64>(o, qs, q_row_stride, kc, vc, tables, lens, batch, num_heads, num_kv_heads,
                                           block_size, max_blocks, s, heads_per_task);
      }
      if (tiled && head_dim == 128) {
        return llm_cpu::tile_kernel<T, 128>(o, qs, q_row_stride, kc, vc, tables, lens, batch, num_heads, num_kv_heads,
                                            block_size, max_blocks, s, heads_per_task);
      }
    }
    llm_cpu::generic_kernel<T>(o, qs, q_row_stride, kc, vc, tables, lens, batch, num_heads, num_kv_heads, head_dim,
                               block_size, max_blocks, s);
  });
}

// out, q: [rows, num_heads, head_dim], the prefill rows packed (sequence p's rows cu_seqlens[p]..cu_seqlens[p+1]-1);
// out contiguous, q with heads and head_dim contiguous in each row (a view of the fused QKV output will do);
// block_tables: [num_seqs, max_blocks] int64; cu_seqlens: [num_seqs + 1] int64; seq_lens: [num_seqs] int64, each
// sequence's context after this step (its rows are the last positions). Returns false, computing nothing, for
// shapes the tiled kernel does not cover (head_dim other than 64 / 128, fp16, more than 16 query heads per KV head).
bool paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                             torch::Tensor block_tables, torch::Tensor cu_seqlens, torch::Tensor seq_lens,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: [rows, num_heads, head_dim], each row's heads contiguous");
  TORCH_CHECK(out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous()
              && block_tables.is_contiguous() && cu_seqlens.is_contiguous() && seq_lens.is_contiguous(),
              "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && cu_seqlens.scalar_type() == at::kLong
              && seq_lens.scalar_type() == at::kLong, "block_tables, cu_seqlens and seq_lens must be int64");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && q.scalar_type() == key_cache.scalar_type()
              && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "q, out [rows, heads, head_dim] and caches [blocks, block_size, kv_heads, head_dim] of one dtype");
  const int64_t num_seqs = seq_lens.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) == num_seqs + 1, "cu_seqlens [num_seqs + 1]");
  check_paged_inputs(key_cache, value_cache, block_tables, seq_lens, num_seqs);
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] <= q.size(0), "cu_seqlens must start at 0 and end within q's ", q.size(0),
              " rows");
  for (int64_t i = 0; i < num_seqs; ++i) {
    TORCH_CHECK(cu[i] <= cu[i + 1] && cu[i + 1] - cu[i] <= lens[i], "sequence ", i, ": rows ", cu[i], "..",
                cu[i + 1], " of q are not the last positions of its ", lens[i], " (cu_seqlens must not decrease, and "
                "a sequence has at most seq_len rows)");
  }
  if (num_heads / num_kv_heads > llm_cpu::MAX_GROUP || (head_dim != 64 && head_dim != 128)) return false;
  bool handled = false;
  llm_cpu::dispatch_float_types(q.scalar_type(), "paged_prefill_attention", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, llm_cpu::bf16>) {
      T* o = reinterpret_cast<T*>(out.data_ptr());
      const T* qs = reinterpret_cast<const T*>(q.data_ptr());
      const T* kc = reinterpret_cast<const T*>(key_cache.data_ptr());
      const T* vc = reinterpret_cast<const T*>(value_cache.data_ptr());
#if LLM_HAVE_AMX
      if constexpr (std::is_same_v<T, llm_cpu::bf16>) {
        if (block_size % 16 == 0 && llm_cpu::amx_usable()) {
          const auto amx = head_dim == 64 ? llm_cpu::amx_prefill_kernel<64> : llm_cpu::amx_prefill_kernel<128>;
          amx(o, qs, q.stride(0), kc, vc, block_tables.data_ptr<int64_t>(), cu_seqlens.data_ptr<int64_t>(),
              seq_lens.data_ptr<int64_t>(), num_seqs, num_heads, num_kv_heads, block_size, block_tables.size(1),
              static_cast<float>(scale));
          handled = true;
          return;
        }
      }
#endif
      const auto run = head_dim == 64 ? llm_cpu::prefill_tile_kernel<T, 64> : llm_cpu::prefill_tile_kernel<T, 128>;
      run(o, qs, q.stride(0), kc, vc, block_tables.data_ptr<int64_t>(), cu_seqlens.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
          num_seqs, num_heads, num_kv_heads, block_size, block_tables.size(1), static_cast<float>(scale));
      handled = true;
    }
  });
  return handled;
}
