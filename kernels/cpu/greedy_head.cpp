// Greedy decoding's pick from an fp32 LM head without all of its fp32 logits: a bf16 pass over the vocabulary
// with a proven error bound per logit, then the exact fp32 logit only for the few tokens the bound cannot rule out.
// The LM head of a small model is a large share of a decode step (SmolLM2-135M: 28 of 135 M weights, 21% of an
// fp32 step's multiply-adds), and on CPUs with AVX512-BF16 its bf16 GEMM reads half the bytes and runs on hardware
// bf16 multiply-adds. The pick is the token the fp32 logits would give,
// bit for bit: the exact logits of the candidates are computed in small_gemm's fp32 summation order.
//
// The bound. x: a row's fp32 hidden state, W_i: the fp32 weight row of token i, y_i = fl(x . W_i) the fp32 logit
// (one rounding per multiply-add, k in order), x' = bf16(x), W'_i = bf16(W_i), z_i = the fp32 sum of the exact
// bf16 products (vdpbf16ps). With dx = x - x', dW_i = W_i - W'_i and g = K u / (1 - K u), u = 2^-24 (Higham,
// Accuracy and Stability of Numerical Algorithms, sec. 3.1: a sum of K terms in floating point is within
// g * sum |terms| of the exact one, in any order):
//   x . W_i - x' . W'_i = dx . W'_i + x' . dW_i + dx . dW_i,
//   |z_i - y_i| <= |dx| |W'_i| + |x'| |dW_i| + |dx| |dW_i| + g (|x'| |W'_i| + |x| |W_i|)   (Cauchy-Schwarz)
//              = a |W'_i| + b |dW_i|,  a = |dx| + g (|x'| + |x|),  b = |x'| + |dx| + g |x|,
// norms precomputed per token (rounded up) and per row (in double), inflated by 2^-10 for their own rounding, plus
// 2^-22 |z_i| for the rounding of z_i +- e_i and 1e-30 for sums vdpbf16ps flushes to zero. x' and W' have their bf16
// denormals set to zero here (whether or not the CPU would flush them, it multiplies what the norms describe). Token i
// can be the argmax only if z_i + e_i >= max_j (z_j - e_j) = L; the threshold only rises as the vocabulary is
// scanned, so a token kept against the running threshold and then against the final one is exactly such a token.
// Among them the first index of the largest exact y_i is the argmax of all y (any other token has y < L).
#include "common.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <limits>
#include <utility>
#include <vector>

// Whether greedy_head runs here (it needs AVX512-BF16's dot products).
bool greedy_head_available() { return LLM_HAVE_AVX512_BF16; }

// out: [M] int64, each row's argmax of the fp32 logits x @ weight^T, or -1 for a row whose hidden state is not
// finite or so large that the bound could overflow, |x| or |x| max |W_i| at 1e30 or more (the caller computes those
// rows' logits). x: [M, K] fp32
// contiguous. packed: small_gemm_pack(bf16(weight)), [V / 16, K / 2, 16, 2]. norms / error_norms: [V] fp32, at least
// |bf16(W_i)| and |W_i - bf16(W_i)|. weight: [V, K] fp32 contiguous. Returns the number of exact logits computed.
int64_t greedy_head(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor norms,
                    torch::Tensor error_norms, torch::Tensor weight) {
  TORCH_CHECK(LLM_HAVE_AVX512_BF16, "greedy_head: AVX512-BF16 is not available");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), V = NB * 16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && K % 32 == 0,
              "greedy_head: x fp32 [M, K] contiguous, K % 32 == 0");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(1) * 2 == K,
              "greedy_head: packed bf16 [V / 16, K / 2, 16, 2]");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat
              && weight.size(0) == V && weight.size(1) == K, "greedy_head: weight fp32 [V, K] contiguous");
  TORCH_CHECK(norms.is_contiguous() && error_norms.is_contiguous() && norms.numel() == V && error_norms.numel() == V
              && norms.scalar_type() == at::kFloat && error_norms.scalar_type() == at::kFloat,
              "greedy_head: norms, error_norms fp32 [V]");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kLong && out.numel() == M, "greedy_head: out [M] int64");
  TORCH_CHECK(V > 0, "greedy_head: an empty vocabulary");
  int64_t* picks = out.data_ptr<int64_t>();
  int64_t exact = 0;
#if LLM_HAVE_AVX512_BF16
  using namespace llm_cpu;
  const float* xs = x.data_ptr<float>();
  const bf16* ws = reinterpret_cast<const bf16*>(packed.data_ptr());
  const float* wn = norms.data_ptr<float>();
  const float* dwn = error_norms.data_ptr<float>();
  const float* w32 = weight.data_ptr<float>();
  // Each row in bf16, and its bound's coefficients.
  std::vector<bf16> xb(M * K);
  std::vector<float> coef_a(M), coef_b(M);
  std::vector<char> usable(M);
  const double g = K * 0x1p-24 / (1 - K * 0x1p-24);
  const float max_norm = std::max(*std::max_element(wn, wn + V), *std::max_element(dwn, dwn + V));
  for (int64_t m = 0; m < M; ++m) {
    double nx = 0, nxb = 0, ndx = 0;
    for (int64_t k = 0; k < K; ++k) {
      const float v = xs[m * K + k];
      bf16 b = from_float<bf16>(v);
      if ((b & 0x7F80u) == 0) b = 0;  // bf16 denormals as zero, so the dot products see what the bound assumes
      const double vb = to_float(b);
      xb[m * K + k] = b;
      nx += double(v) * v;
      nxb += vb * vb;
      ndx += (v - vb) * (v - vb);
    }
    nx = std::sqrt(nx), nxb = std::sqrt(nxb), ndx = std::sqrt(ndx);
    const double a = (ndx + g * (nxb + nx)) * (1 + 0x1p-10), b = (nxb + ndx + g * nx) * (1 + 0x1p-10);
    // Products, sums and the bound's coefficients stay far from fp32's range (|x| alone too: a head of tiny weights
    // would pass the first test with a row whose bf16 copy or |x'| overflows).
    usable[m] = nx < 1e30 && nx * max_norm < 1e30;
    coef_a[m] = usable[m] ? static_cast<float>(a) : 0.f;
    coef_b[m] = usable[m] ? static_cast<float>(b) : 0.f;
  }
  const int64_t groups = (NB + 3) / 4;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), groups));
  // Per thread: each row's running threshold and the tokens kept against it (index, z + e).
  std::vector<std::vector<float>> thresholds(threads, std::vector<float>(M, -std::numeric_limits<float>::infinity()));
  std::vector<std::vector<std::vector<std::pair<int32_t, float>>>> kept(
      threads, std::vector<std::vector<std::pair<int32_t, float>>>(M));
  std::atomic<int64_t> taken{0};
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    float* threshold = thresholds[t].data();
    auto& mine = kept[t];
    alignas(64) float c[6 * 64];
    const __m512 inflate = _mm512_set1_ps(0x1p-22f), tiny = _mm512_set1_ps(1e-30f);
    for (int64_t gi = taken.fetch_add(1); gi < groups; gi = taken.fetch_add(1)) {
      const int64_t nb0 = 4 * gi, nbs = std::min<int64_t>(4, NB - nb0);
      const bf16* w = ws + nb0 * K * 16;
      const NextGroup next(ws, gi, threads, groups, NB, K, M);  // prefetched as small_gemm does
      for (int64_t m0 = 0; m0 < M; m0 += 6) {
        const int64_t rows = std::min<int64_t>(6, M - m0), pass = m0 / 6;
        const char* pf = next.share(pass);
        const int64_t pf_lines = next.share_lines(pass);
        with_constant<6>(rows, [&](auto mb) {
          constexpr int MB = decltype(mb)::value;
          if (nbs == 4) dp_block<MB, 4>(xb.data() + m0 * K, K, w, K * 16, c, pf, pf_lines);
          else for (int64_t j = 0; j < nbs; ++j) dp_block<MB, 1>(xb.data() + m0 * K, K, w + j * K * 16, K * 16, c + 16 * j);
        });
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t m = m0 + r;
          if (!usable[m]) continue;
          const __m512 a = _mm512_set1_ps(coef_a[m]), b = _mm512_set1_ps(coef_b[m]);
          __m512 hi[4], lo_max = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          for (int64_t j = 0; j < nbs; ++j) {
            const int64_t v0 = (nb0 + j) * 16;
            const __m512 z = _mm512_load_ps(c + r * 64 + 16 * j);
            __m512 e = _mm512_fmadd_ps(a, _mm512_loadu_ps(wn + v0), _mm512_mul_ps(b, _mm512_loadu_ps(dwn + v0)));
            e = _mm512_fmadd_ps(inflate, _mm512_abs_ps(z), _mm512_add_ps(e, tiny));
            hi[j] = _mm512_add_ps(z, e);
            lo_max = _mm512_max_ps(lo_max, _mm512_sub_ps(z, e));
          }
          threshold[m] = std::max(threshold[m], _mm512_reduce_max_ps(lo_max));
          const __m512 bar = _mm512_set1_ps(threshold[m]);
          for (int64_t j = 0; j < nbs; ++j) {
            uint32_t mask = _mm512_cmp_ps_mask(hi[j], bar, _CMP_GE_OQ);
            if (!mask) continue;
            alignas(64) float his[16];
            _mm512_store_ps(his, hi[j]);
            for (; mask; mask &= mask - 1) {
              const int lane = __builtin_ctz(mask);
              mine[m].emplace_back(static_cast<int32_t>((nb0 + j) * 16 + lane), his[lane]);
            }
          }
        }
      }
    }
  }
  // Each row: the candidates that clear the final threshold, their exact fp32 logits (small_gemm's order: one
  // multiply-add per k, k ascending, from zero), the first index of the largest.
  std::vector<int64_t> counts(M, 0);
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      if (!usable[m]) { picks[m] = -1; continue; }
      float bar = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < threads; ++t) bar = std::max(bar, thresholds[t][m]);
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_index = -1;
      for (int t = 0; t < threads; ++t) {
        for (const auto& [index, high] : kept[t][m]) {
          if (!(high >= bar)) continue;
          const float* row = w32 + static_cast<int64_t>(index) * K;
          const float* xr = xs + m * K;
          float acc = 0.f;
          for (int64_t k = 0; k < K; ++k) acc = std::fma(xr[k], row[k], acc);
          ++counts[m];
          if (acc > best || (acc == best && index < best_index)) { best = acc; best_index = index; }
        }
      }
      picks[m] = std::isfinite(best) ? best_index : -1;
    }
  });
  for (int64_t m = 0; m < M; ++m) exact += counts[m];
#endif
  return exact;
}
