"""Triton kernels for paged attention over a block-structured KV cache.

Cache layout (per layer): key_cache and value_cache, each
[num_blocks, block_size, num_kv_heads, head_dim]; slot = block_id * block_size
+ offset_in_block; block tables are int32 [num_seqs, max_blocks_per_seq]
(PagedAttention, Kwon et al., SOSP 2023).

- `reshape_and_cache`: write new tokens' keys/values into their slots.
- `paged_decode_attention`: one query token per sequence, with split-K over the
  context (Flash-Decoding, Dao et al., 2023).
- `paged_prefill_attention`: packed variable-length causal queries (prefill with
  or without a cached prefix, and decodes in the same batch).
- `reference`: plain PyTorch versions of the three, for testing.
- `cpu`: the C++ paged decode attention for CPUs (compiled on first use; see kernels/cpu/__init__.py).

Both attention kernels use the online softmax of FlashAttention-2 (Dao, 2023)
with fp32 accumulation. Importing this package needs no GPU; set
TRITON_INTERPRET=1 before importing it to run the kernels on CPU tensors.
"""

from . import reference
from .decode_attention import paged_decode_attention
from .prefill_attention import paged_prefill_attention
from .reshape_and_cache import reshape_and_cache

__all__ = ["paged_decode_attention", "paged_prefill_attention", "reference", "reshape_and_cache"]
