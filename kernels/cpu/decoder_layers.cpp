// The compact decoder's layers (backend/models/llama.py) for a decode step small_gemm takes (at most 64 rows on
// AMX, 256 elsewhere: small_gemm_max_rows; int8 weights: int8_gemm_max_rows), in one call.
// A decode step on two cores runs ~10 kernels a layer, each a few tens of microseconds at such batches; driven
// from Python, every call also pays the interpreter, argument parsing and an output allocation, ~360 calls a
// step for SmolLM2's 30 layers. The same kernels in the same order from here; the results are bit-identical to the
// Python loop. (The CPU's counterpart of replaying a CUDA graph captured for decode steps, as vLLM and nano-vllm do
// on GPUs.) Beyond saving the interpreter, the step's activations are allocated once for all layers, rotary and the
// KV write run as one pass over the tokens, and the attention reads the queries in place in the fused QKV rows:
// at 27 rows on SmolLM2-135M (bf16, 2 cores) each tensor view, allocation or copy cost microseconds a layer.
#include "common.h"

#include <ATen/Parallel.h>

#include <tuple>
#include <vector>

// Tensors per layer in `layers` (see decode_layers).
constexpr int64_t DECODE_LAYER_TENSORS = 10;

namespace llm_cpu {
namespace {
// qkv: [rows, qkv_width] contiguous, each row num_heads query heads, then num_kv_heads key heads, then as many value
// heads, head_dim each. Per row, in one parallel pass: rotary on the query and key heads in place
// (rotary_embedding's rotate_head), then the row's key and value heads to its slot (write_kv's store).
// cos, sin: [rows, head_dim] contiguous; slots: [rows], each below the pool's size or negative (none): checked by the
// caller.
template <typename T>
void rotate_and_store_kv(T* qkv, int64_t rows, int64_t qkv_width, const T* cos, const T* sin, const int64_t* slots,
                         const KvSlots& pool, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t grain = std::max<int64_t>(1, 8192 / ((num_heads + num_kv_heads) * head_dim));  // rotary's
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * qkv_width;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h)
        rotate_head<T>(row + h * head_dim, cos + t * head_dim, sin + t * head_dim, head_dim / 2);
      const T* key = row + num_heads * head_dim;
      pool.store(slots[t], reinterpret_cast<const char*>(key),
                 reinterpret_cast<const char*>(key + num_kv_heads * head_dim));
    }
    KvSlots::fence();
  });
}
}  // namespace
}  // namespace llm_cpu

// hidden: [rows, hidden_size] (the token embeddings), rows <= small_gemm_max_rows; cos, sin: [rows, head_dim] (each
// row's rotary tables); slot_mapping: [rows] int64; block_tables: [rows, max_blocks] int64; seq_lens: [rows] int64
// (contexts with the new token). layers: DECODE_LAYER_TENSORS per layer: input norm weight, QKV packed by
// small_gemm_pack, QKV bias (empty: none), O packed, O bias (empty: none), post-attention norm weight, gate-up
// packed, down packed, key cache, value cache. A packed weight of dtype int8 (int8_gemm_pack) runs through int8_gemm,
// with int8 activations (W8A8) where int8_activations. Every layer has the first one's shapes; every layer and slot
// is checked before the first KV write. Returns (hidden, residual) after the last layer, as the Python loop leaves
// them.
std::tuple<torch::Tensor, torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                                                       torch::Tensor slot_mapping, torch::Tensor block_tables,
                                                       torch::Tensor seq_lens, std::vector<torch::Tensor> layers,
                                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                                       double eps, double scale, bool int8_activations) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && !layers.empty()
              && layers.size() % DECODE_LAYER_TENSORS == 0, "decode_layers: hidden [rows, d] contiguous, ",
              DECODE_LAYER_TENSORS, " tensors per layer");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16,
              "decode_layers: fp32 or bf16 activations, got ", hidden.scalar_type());
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_layers: head_dim even and positive, num_heads a positive multiple of num_kv_heads");
  const int64_t rows = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2
              && cos.size(0) == rows && cos.size(1) == head_dim && sin.sizes() == cos.sizes()
              && cos.scalar_type() == hidden.scalar_type() && sin.scalar_type() == hidden.scalar_type(),
              "decode_layers: cos, sin [rows, head_dim] contiguous, of hidden's dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == rows && slot_mapping.is_contiguous()
              && slot_mapping.scalar_type() == at::kLong, "decode_layers: slot_mapping [rows] int64");
  // The step's activations, written anew by every layer. Each GEMM's width is its packed weight's (blocks of 16).
  const auto options = hidden.options();
  const int64_t hidden_size = hidden.size(1);
  const int64_t qkv_width = layers[1].size(0) * 16, gate_up_width = layers[6].size(0) * 16;
  TORCH_CHECK(qkv_width >= q_size + 2 * kv_size && gate_up_width % 2 == 0, "decode_layers: QKV / gate-up widths");
  // Every layer checked before the first one writes its KV cache: a bad request leaves every cache as it was.
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (size_t first = 0; first < layers.size(); first += DECODE_LAYER_TENSORS) {
    const torch::Tensor* w = layers.data() + first;
    TORCH_CHECK(w[1].size(0) * 16 == qkv_width && w[3].size(0) * 16 == hidden_size && w[6].size(0) * 16 == gate_up_width
                && w[7].size(0) * 16 == hidden_size, "decode_layers: layer ", first / DECODE_LAYER_TENSORS,
                "'s GEMM widths differ from the first layer's (QKV, gate-up) or from hidden_size (O, down)");
    TORCH_CHECK(w[8].scalar_type() == hidden.scalar_type() && w[8].dim() == 4 && w[8].size(2) == num_kv_heads
                && w[8].size(3) == head_dim, "decode_layers: layer ", first / DECODE_LAYER_TENSORS,
                "'s caches: [blocks, block_size, num_kv_heads, head_dim] of hidden's dtype");
    llm_cpu::KvSlots(w[8], w[9]).check(slots, rows);
  }
  torch::Tensor qkv = torch::empty({rows, qkv_width}, options);
  torch::Tensor q = qkv.as_strided({rows, num_heads, head_dim}, {qkv_width, head_dim, 1});
  torch::Tensor attn = torch::empty({rows, num_heads, head_dim}, options);
  torch::Tensor attn_rows = attn.view({rows, q_size});
  torch::Tensor gate_up = torch::empty({rows, gate_up_width}, options);
  torch::Tensor act = torch::empty({rows, gate_up_width / 2}, options);
  auto bias = [](const torch::Tensor& b) { return b.numel() ? c10::optional<torch::Tensor>(b) : c10::nullopt; };
  auto gemm = [&](torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& packed,
                  const c10::optional<torch::Tensor>& b) {
    if (packed.scalar_type() == at::kChar) int8_gemm(out, x, packed, b, int8_activations);  // int8_gemm_pack's
    else small_gemm(out, x, packed, b);
  };
  torch::Tensor residual = hidden;  // the first layer: the embeddings are the residual stream
  hidden = torch::empty_like(residual);
  for (size_t first = 0; first < layers.size(); first += DECODE_LAYER_TENSORS) {
    const torch::Tensor* w = layers.data() + first;
    if (first == 0) rms_norm(hidden.unsqueeze(1), residual.unsqueeze(1), w[0], eps);
    else fused_add_rms_norm(hidden, residual, w[0], eps);
    gemm(qkv, hidden, w[1], bias(w[2]));
    llm_cpu::dispatch_float_types(qkv.scalar_type(), "decode_layers", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      llm_cpu::rotate_and_store_kv<T>(reinterpret_cast<T*>(qkv.data_ptr()), rows, qkv_width,
                                      reinterpret_cast<const T*>(cos.data_ptr()),
                                      reinterpret_cast<const T*>(sin.data_ptr()), slots,
                                      llm_cpu::KvSlots(w[8], w[9]), num_heads, num_kv_heads, head_dim);
    });
    paged_decode_attention(attn, q, w[8], w[9], block_tables, seq_lens, scale);
    gemm(hidden, attn_rows, w[3], bias(w[4]));
    fused_add_rms_norm(hidden, residual, w[5], eps);
    gemm(gate_up, hidden, w[6], c10::nullopt);
    silu_and_mul(act, gate_up);
    gemm(hidden, act, w[7], c10::nullopt);
  }
  return {hidden, residual};
}
