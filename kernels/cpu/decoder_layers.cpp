// The compact decoder's layers (backend/models/llama.py) for a decode step small_gemm takes (at most 64 rows on
// AMX, 256 elsewhere: small_gemm_max_rows; int8 weights: int8_gemm_max_rows), in one call.
// A decode step on two cores runs ~12 kernels a layer, each a few hundred microseconds at such batches; driven
// from Python, every call also pays the interpreter, argument parsing and an output allocation, ~360 calls a
// step for SmolLM2's 30 layers. The same kernels in the same order from here; the results are bit-identical to the Python loop.
// (The CPU's counterpart of replaying a CUDA graph captured for decode steps, as vLLM and nano-vllm do on GPUs.)
#include "common.h"

#include <tuple>
#include <vector>

// Tensors per layer in `layers` (see decode_layers).
constexpr int64_t DECODE_LAYER_TENSORS = 10;

// hidden: [rows, hidden_size] (the token embeddings), rows <= small_gemm_max_rows; cos, sin: [rows, head_dim] (each
// row's rotary tables); slot_mapping: [rows] int64; block_tables: [rows, max_blocks] int64; seq_lens: [rows] int64
// (contexts with the new token). layers: DECODE_LAYER_TENSORS per layer: input norm weight, QKV packed by
// small_gemm_pack, QKV bias (empty: none), O packed, O bias (empty: none), post-attention norm weight, gate-up
// packed, down packed, key cache, value cache. A packed weight of dtype int8 (int8_gemm_pack) runs through int8_gemm,
// with int8 activations (W8A8) where int8_activations. Returns (hidden, residual) after the last layer, as the Python
// loop leaves them.
std::tuple<torch::Tensor, torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                                                       torch::Tensor slot_mapping, torch::Tensor block_tables,
                                                       torch::Tensor seq_lens, std::vector<torch::Tensor> layers,
                                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                                       double eps, double scale, bool int8_activations) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && !layers.empty()
              && layers.size() % DECODE_LAYER_TENSORS == 0, "decode_layers: hidden [rows, d] contiguous, ",
              DECODE_LAYER_TENSORS, " tensors per layer");
  const int64_t rows = hidden.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  auto bias = [](const torch::Tensor& b) { return b.numel() ? c10::optional<torch::Tensor>(b) : c10::nullopt; };
  auto gemm = [&](const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& b) {
    torch::Tensor out = torch::empty({x.size(0), packed.size(0) * 16}, x.options());
    if (packed.scalar_type() == at::kChar) int8_gemm(out, x, packed, b, int8_activations);  // weights from int8_gemm_pack
    else small_gemm(out, x, packed, b);
    return out;
  };
  torch::Tensor residual;
  for (size_t first = 0; first < layers.size(); first += DECODE_LAYER_TENSORS) {
    const torch::Tensor* w = layers.data() + first;
    if (!residual.defined()) {  // the first layer: the embeddings are the residual stream
      residual = hidden;
      hidden = torch::empty_like(residual);
      rms_norm(hidden.unsqueeze(1), residual.unsqueeze(1), w[0], eps);
    } else {
      fused_add_rms_norm(hidden, residual, w[0], eps);
    }
    torch::Tensor qkv = gemm(hidden, w[1], bias(w[2]));
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads, head_dim});
    torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads, head_dim});
    rotary_embedding(q, k, cos, sin);
    write_kv(k, v, w[8], w[9], slot_mapping);
    torch::Tensor attn = torch::empty({rows, num_heads, head_dim}, hidden.options());
    paged_decode_attention(attn, q.contiguous(), w[8], w[9], block_tables, seq_lens, scale);
    hidden = gemm(attn.view({rows, q_size}), w[3], bias(w[4]));
    fused_add_rms_norm(hidden, residual, w[5], eps);
    torch::Tensor gate_up = gemm(hidden, w[6], c10::nullopt);
    torch::Tensor act = torch::empty({rows, gate_up.size(1) / 2}, hidden.options());
    silu_and_mul(act, gate_up);
    hidden = gemm(act, w[7], c10::nullopt);
  }
  return {hidden, residual};
}
