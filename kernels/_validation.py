"""Argument checks shared by the paged-attention kernel wrappers.

Only shapes, dtypes and devices are checked: checking values (slot ids,
sequence lengths, block ids) would need a device-to-host copy on every call.
Every failure raises ValueError with the offending name and shape.
"""

import torch


def check_tensor(name, tensor, ndim, dtype=None):
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {tensor.dtype}")


def check_caches(key_cache, value_cache):
    """Check the paged caches; return (num_blocks, block_size, num_kv_heads, head_dim)."""
    check_tensor("key_cache", key_cache, 4)
    check_tensor("value_cache", value_cache, 4)
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache and value_cache shapes differ: {tuple(key_cache.shape)} vs {tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache and value_cache dtypes differ: {key_cache.dtype} vs {value_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    head_dim = key_cache.shape[3]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    return tuple(key_cache.shape)


def check_query(query, key_cache):
    """Check query [tokens, num_heads, head_dim] against the cache; return num_heads."""
    check_tensor("query", query, 3)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} does not match the cache head_dim {head_dim}")
    if query.dtype != key_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} does not match the cache dtype {key_cache.dtype}")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads


def check_batch(block_tables, seq_lens, num_seqs):
    check_tensor("block_tables", block_tables, 2, torch.int32)
    check_tensor("seq_lens", seq_lens, 1, torch.int32)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"expected {num_seqs} sequences, got block_tables {tuple(block_tables.shape)} "
            f"and seq_lens {tuple(seq_lens.shape)}"
        )


def check_same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def last_dim_contiguous(tensor):
    """The kernels index the last dimension with stride 1; copy only if it is not."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def check_variants(sliding_window, softcap, sinks, num_heads, query):
    """Check the attention variants; return sinks as a contiguous fp32 tensor on query's device (or None)."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap!r}")
    if sinks is None:
        return None
    check_tensor("sinks", sinks, 1)
    if sinks.shape[0] != num_heads:
        raise ValueError(f"sinks must have one logit per query head ({num_heads}), got shape {tuple(sinks.shape)}")
    check_same_device(query=query, sinks=sinks)
    return sinks.detach().float().contiguous()
