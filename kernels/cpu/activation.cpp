// SwiGLU's gate (Shazeer 2020, "GLU Variants Improve Transformer"): silu(gate) * up over the fused gate-up
// GEMM's output, in one pass. Rounds where transformers' MLP rounds: silu(gate) to the model's dtype, then the
// product.
#include "common.h"

#include <ATen/Parallel.h>

// out: [tokens, d] contiguous; gate_up: [tokens, 2 * d] with unit stride in the last dimension (gate, then up).
void silu_and_mul(torch::Tensor out, torch::Tensor gate_up) {
  using namespace llm_cpu;
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && out.is_contiguous() && out.dim() == 2
              && out.size(0) == gate_up.size(0) && 2 * out.size(1) == gate_up.size(1)
              && out.scalar_type() == gate_up.scalar_type(), "silu_and_mul: out [tokens, d], gate_up [tokens, 2d]");
  const int64_t tokens = out.size(0), d = out.size(1);
  dispatch_float_types(out.scalar_type(), "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* o = reinterpret_cast<T*>(out.data_ptr());
    const T* gu = reinterpret_cast<const T*>(gate_up.data_ptr());
    at::parallel_for(0, tokens, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* gate = gu + t * gate_up.stride(0);
        const T* up = gate + d;
        T* dst = o + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) {
          const float g = to_float(gate[i]);
          const float e = exp_nonpositive(-std::fabs(g));  // sigmoid without overflow for either sign
          const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
          dst[i] = from_float<T>(round_to<T>(g * sigmoid) * to_float(up[i]));
        }
      }
    });
  });
}
