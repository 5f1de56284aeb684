// Writes the step's K and V into the paged pool through the slot mapping (vLLM's reshape_and_cache, for CPUs):
// one pass copying each token's K and V rows, instead of an index_copy_ per tensor (torch's generic scatter,
// ~58 us a call for 150 tokens: 3.5 ms of a decode step's 86 at batch 150 on 2 cores).
// Rows that are whole cache lines go with streaming stores: a decode step's slots lie scattered in a pool far
// larger than the caches, and an ordinary store first reads each line in (98 us a layer at batch 48, bf16, 2
// threads; the same copy with the lines already in cache takes 9 us).
#include "common.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>

namespace llm_cpu {
namespace {
// dst and bytes multiples of 64: full lines, written around the caches (no read for ownership).
inline void stream_copy(char* dst, const char* src, int64_t bytes) {
#if defined(__AVX512F__)
  for (int64_t b = 0; b < bytes; b += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + b), _mm512_loadu_si512(src + b));
#else
  std::memcpy(dst, src, bytes);
#endif
}
}  // namespace

// One layer's paged pool as write_kv stores to it: key_cache, value_cache [num_blocks, block_size, num_kv_heads,
// head_dim] contiguous, of one dtype (checked on construction); a slot is block * block_size + offset.
class KvSlots {
 public:
  KvSlots(const torch::Tensor& key_cache, const torch::Tensor& value_cache)
      : keys_(static_cast<char*>(key_cache.data_ptr())), values_(static_cast<char*>(value_cache.data_ptr())) {
    TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous()
                && value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == key_cache.scalar_type(),
                "KV caches: [num_blocks, block_size, heads, dim] contiguous, of one dtype");
    row_bytes_ = key_cache.size(2) * key_cache.size(3) * key_cache.element_size();
    num_slots_ = key_cache.size(0) * key_cache.size(1);
    whole_lines_ = row_bytes_ % 64 == 0 && reinterpret_cast<uintptr_t>(keys_) % 64 == 0
                   && reinterpret_cast<uintptr_t>(values_) % 64 == 0;
  }

  // Raises unless every slot is below the pool's size (before anything is written).
  void check(const int64_t* slots, int64_t tokens) const {
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(slots[t] < num_slots_, "KV slot ", slots[t], " out of range: the pool has ", num_slots_, " slots");
  }

  // One token's key and value rows (num_kv_heads x head_dim elements each, contiguous) to `slot`; slot < 0: nothing.
  // Rows that are whole lines go with streaming stores; call fence() on the same thread before others read them.
  void store(int64_t slot, const char* key, const char* value) const {
    if (slot < 0) return;
    if (whole_lines_) {
      stream_copy(keys_ + slot * row_bytes_, key, row_bytes_);
      stream_copy(values_ + slot * row_bytes_, value, row_bytes_);
    } else {
      std::memcpy(keys_ + slot * row_bytes_, key, row_bytes_);
      std::memcpy(values_ + slot * row_bytes_, value, row_bytes_);
    }
  }

  // Streaming stores are weakly ordered: this makes a thread's stores visible before the attention's threads read.
  static void fence() {
#if defined(__AVX512F__)
    _mm_sfence();
#endif
  }

  int64_t row_bytes() const { return row_bytes_; }

 private:
  char* keys_;
  char* values_;
  int64_t row_bytes_, num_slots_;
  bool whole_lines_;
};
}  // namespace llm_cpu

// key, value: [tokens, num_kv_heads, head_dim], each token's heads contiguous (views into the fused QKV output
// are), any row stride; key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] contiguous;
// slot_mapping: [tokens] int64, block * block_size + offset; slots < 0 are skipped (padding).
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping) {
  const llm_cpu::KvSlots pool(key_cache, value_cache);
  const int64_t heads = key_cache.size(2), dim = key_cache.size(3), tokens = key.size(0);
  for (const auto& x : {key, value}) {
    TORCH_CHECK(x.dim() == 3 && x.size(0) == tokens && x.size(1) == heads && x.size(2) == dim && x.stride(2) == 1
                && x.stride(1) == dim && x.scalar_type() == key_cache.scalar_type(),
                "write_kv: key and value [tokens, heads, dim] of the caches' dtype, heads contiguous per token");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens && slot_mapping.is_contiguous()
              && slot_mapping.scalar_type() == at::kLong, "write_kv: slot_mapping [tokens] int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  pool.check(slots, tokens);
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t elem = key.element_size(), k_stride = key.stride(0) * elem, v_stride = value.stride(0) * elem;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) pool.store(slots[t], k + t * k_stride, v + t * v_stride);
    llm_cpu::KvSlots::fence();
  });
}

// A [nbytes] uint8 buffer for a layer's paged pool, on 2 MiB transparent huge pages where the kernel grants them
// (the part past the last whole one, and all of it where they are refused, on 4 KiB pages), contents undefined.
// A decode step reads each sequence's blocks scattered over a pool far larger than what the TLB maps in 4 KiB
// pages, so most block reads would first walk the page table.
torch::Tensor kv_pool_buffer(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "kv_pool_buffer: nbytes must be positive, got ", nbytes);
  return llm_cpu::empty_on_huge_pages({nbytes}, torch::TensorOptions().dtype(torch::kUInt8), false);
}
