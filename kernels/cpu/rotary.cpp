// Rotary position embedding (Su et al. 2021, RoFormer), "rotate half" layout of Llama-family checkpoints,
// applied in place to the query and key heads of the fused QKV output: one pass instead of eager torch's
// slice, negate, concatenate, multiply and add per tensor. Rounds where transformers' apply_rotary_pos_emb
// rounds: x*cos and rotate_half(x)*sin each to the model's dtype, then their sum.
#include "common.h"

#include <ATen/Parallel.h>

namespace llm_cpu {
namespace {

template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float c1 = to_float(cos[i]), c2 = to_float(cos[i + half]);
    const float s1 = to_float(sin[i]), s2 = to_float(sin[i + half]);
    x[i] = from_float<T>(round_to<T>(x1 * c1) + round_to<T>(-x2 * s1));
    x[i + half] = from_float<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
  }
}

}  // namespace
}  // namespace llm_cpu

// query: [tokens, num_heads, head_dim], key: [tokens, num_kv_heads, head_dim], both with unit stride in
// head_dim (e.g. views into the fused QKV output), rotated in place; cos, sin: [tokens, head_dim] contiguous,
// the rows for each token's position.
void rotary_embedding(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin) {
  using namespace llm_cpu;
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && query.stride(2) == 1 && key.stride(2) == 1,
              "rotary_embedding: query and key must be [tokens, heads, head_dim] with unit stride in head_dim");
  const int64_t tokens = query.size(0), head_dim = query.size(2);
  TORCH_CHECK(key.size(0) == tokens && key.size(2) == head_dim && head_dim > 0 && head_dim % 2 == 0,
              "rotary_embedding: shapes");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == tokens
              && cos.size(1) == head_dim && sin.sizes() == cos.sizes(), "rotary_embedding: cos/sin [tokens, head_dim]");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && cos.scalar_type() == query.scalar_type()
              && sin.scalar_type() == query.scalar_type(), "rotary_embedding: one dtype");
  const int64_t num_heads = query.size(1), num_kv_heads = key.size(1);
  dispatch_float_types(query.scalar_type(), "rotary_embedding", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* q = reinterpret_cast<T*>(query.data_ptr());
    T* k = reinterpret_cast<T*>(key.data_ptr());
    const T* c = reinterpret_cast<const T*>(cos.data_ptr());
    const T* s = reinterpret_cast<const T*>(sin.data_ptr());
    const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, (num_heads + num_kv_heads) * head_dim));
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* ct = c + t * head_dim;
        const T* st = s + t * head_dim;
        for (int64_t h = 0; h < num_heads; ++h)
          rotate_head<T>(q + t * query.stride(0) + h * query.stride(1), ct, st, head_dim / 2);
        for (int64_t h = 0; h < num_kv_heads; ++h)
          rotate_head<T>(k + t * key.stride(0) + h * key.stride(1), ct, st, head_dim / 2);
      }
    });
  });
}
