"""Write new tokens' keys and values into the paged KV cache (PagedAttention).

The cache layout follows PagedAttention (Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention", SOSP 2023):
each layer has a key_cache and a value_cache of shape
[num_blocks, block_size, num_kv_heads, head_dim], and a token's slot is
block_id * block_size + offset_in_block.
"""

import torch
import triton
import triton.language as tl

from ._validation import check_caches, check_same_device, check_tensor, last_dim_contiguous


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token
        return
    dims = tl.arange(0, HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
    dst += head * stride_cache_head + dims
    key = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + dims)
    value = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + dims)
    tl.store(key_cache_ptr + dst, key)
    tl.store(value_cache_ptr + dst, value)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Scatter new keys and values into the paged caches, in place (PagedAttention layout).

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], same dtype as the caches
            (any strides; the last dimension is made contiguous if it is not).
        key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim],
            contiguous. Modified in place.
        slot_mapping: int64 [num_tokens]; token t goes to slot slot_mapping[t] =
            block_id * block_size + offset_in_block. Entries < 0 are skipped (padding).
            Slots are not range-checked (that would need a device sync).

    Returns:
        None.

    Raises:
        ValueError: on wrong ranks, shapes, dtypes, or tensors on different devices.
    """
    _, block_size, num_kv_heads, head_dim = check_caches(key_cache, value_cache)
    check_tensor("key", key, 3)
    check_tensor("value", value, 3)
    check_tensor("slot_mapping", slot_mapping, 1, torch.int64)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    for name, tensor in (("key", key), ("value", value)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} (num_tokens, num_kv_heads, head_dim), "
                             f"got {tuple(tensor.shape)}")
        if tensor.dtype != key_cache.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} does not match the cache dtype {key_cache.dtype}")
    check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    key, value = last_dim_contiguous(key), last_dim_contiguous(value)

    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
    )
