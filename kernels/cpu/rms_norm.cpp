// RMSNorm (Zhang & Sennrich 2019) for CPUs, with the residual add fused in as vLLM's fused_add_rms_norm does:
// one pass per row instead of eager torch's eight operations and dtype conversions. Rounds where transformers'
// LlamaRMSNorm rounds (the normalized row to the model's dtype, then the product with the weight), so in fp32 it
// equals transformers up to summation order and in bf16 it matches transformers' rounding steps.
#include "common.h"

#include <ATen/Parallel.h>

namespace llm_cpu {
namespace {

// One row of d values: normalizes `in` (already holding the residual sum) into `out`.
template <typename T>
inline void norm_row(T* out, const T* in, const T* weight, int64_t d, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < d; ++i) {
    const float v = to_float(in[i]);
    sum_sq += v * v;
  }
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(to_float(in[i]) * inv));
  }
}

int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)); }

}  // namespace
}  // namespace llm_cpu

// out, x: [a, b, d] with stride 1 in the last dimension (out may be x itself); weight: [d] contiguous.
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  using namespace llm_cpu;
  TORCH_CHECK(x.dim() == 3 && out.sizes() == x.sizes() && x.stride(2) == 1 && out.stride(2) == 1,
              "rms_norm: x and out must be [a, b, d] with unit stride in d");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(2) && weight.scalar_type() == x.scalar_type()
              && out.scalar_type() == x.scalar_type(), "rms_norm: weight [d] and out of x's dtype");
  const int64_t a = x.size(0), b = x.size(1), d = x.size(2);
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = reinterpret_cast<T*>(out.data_ptr());
    const T* in = reinterpret_cast<const T*>(x.data_ptr());
    const T* w = reinterpret_cast<const T*>(weight.data_ptr());
    at::parallel_for(0, a * b, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t i = r / b, j = r % b;
        norm_row<T>(o + i * out.stride(0) + j * out.stride(1), in + i * x.stride(0) + j * x.stride(1), w, d,
                    static_cast<float>(eps));
      }
    });
  });
}

// x, residual: [rows, d] with unit stride in d. residual <- residual + x (rounded to the dtype, as eager
// torch's add); x <- rms_norm(residual) * weight.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  using namespace llm_cpu;
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && x.stride(1) == 1 && residual.stride(1) == 1,
              "fused_add_rms_norm: x and residual must be [rows, d] with unit stride in d");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type()
              && residual.scalar_type() == x.scalar_type(), "fused_add_rms_norm: weight [d], one dtype");
  const int64_t rows = x.size(0), d = x.size(1);
  dispatch_float_types(x.scalar_type(), "fused_add_rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xs = reinterpret_cast<T*>(x.data_ptr());
    T* rs = reinterpret_cast<T*>(residual.data_ptr());
    const T* w = reinterpret_cast<const T*>(weight.data_ptr());
    at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* xr = xs + r * x.stride(0);
        T* rr = rs + r * residual.stride(0);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) rr[i] = from_float<T>(to_float(rr[i]) + to_float(xr[i]));
        norm_row<T>(xr, rr, w, d, static_cast<float>(eps));
      }
    });
  });
}
