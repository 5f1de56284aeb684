// Paged decode attention for CPUs: one query token per sequence, reading K/V blocks in place through the
// block table (PagedAttention, Kwon et al. SOSP 2023, sec. 4.1; vLLM's csrc/cpu has the same shape).
// One task per (sequence, KV head): the query heads that share the KV head (grouped-query attention) are
// scored together, so each key and value row is loaded once. Scores and accumulators are fp32.
#include "common.h"

#include <ATen/Parallel.h>

#include <limits>
#include <type_traits>
#include <vector>

namespace llm_cpu {
namespace {

template <typename T>
void decode_kernel(T* out, const T* q, const T* key_cache, const T* value_cache, const int64_t* block_tables,
                   const int64_t* seq_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
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
        const T* src = q + (seq * num_heads + kv_head * group + g) * head_dim;
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

}  // namespace
}  // namespace llm_cpu

// out, q: [batch, num_heads, head_dim]; key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [batch, max_blocks] int64; seq_lens: [batch] int64 (keys 0..seq_len-1 are attended).
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous()
              && block_tables.is_contiguous() && seq_lens.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4 && q.scalar_type() == key_cache.scalar_type(),
              "q [batch, heads, head_dim] and caches [blocks, block_size, kv_heads, head_dim] of one dtype");
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes do not match");
  llm_cpu::dispatch_float_types(q.scalar_type(), "paged_decode_attention", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    llm_cpu::decode_kernel<T>(reinterpret_cast<T*>(out.data_ptr()), reinterpret_cast<const T*>(q.data_ptr()),
                     reinterpret_cast<const T*>(key_cache.data_ptr()), reinterpret_cast<const T*>(value_cache.data_ptr()),
                     block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), batch, num_heads, num_kv_heads,
                     head_dim, block_size, block_tables.size(1), static_cast<float>(scale));
  });
}
