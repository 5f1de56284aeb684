"""Paged-attention Triton kernels against their PyTorch references.

Without a GPU the kernels run under Triton's interpreter on CPU tensors. Triton
reads TRITON_INTERPRET when a function is decorated with @triton.jit: its own
library functions (tl.cdiv, tl.max, ...) when triton.language is first
imported, and our kernels when `kernels` is imported. conftest.py sets it
before anything imports triton (this module too, when run alone);
test_kernels_run_interpreted_in_this_process fails if triton was imported
too early anyway. With a GPU (and TRITON_INTERPRET unset) the tests run
compiled on CUDA.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

USE_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not USE_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.decode_attention import _decode_split_kernel, choose_num_splits  # noqa: E402

DEVICE = "cuda" if USE_CUDA else "cpu"
INTERPRETED = not USE_CUDA
TRITON_IMPORTED_TOO_EARLY = INTERPRETED and not (
    isinstance(tl.cdiv, InterpretedFunction) and isinstance(_decode_split_kernel, InterpretedFunction)
)
NUM_BLOCKS = 64
TOLERANCE = {  # (atol, rtol); fp16/bf16 outputs are rounded once from fp32
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# The interpreter stores bf16 as uint16 and its tl.dot multiplies the raw bits
# (triton-lang/triton#11584; bf16 arithmetic is unsupported there), so bf16
# attention is only tested compiled. Copies (reshape_and_cache) work.
NEEDS_BF16_DOT = pytest.mark.skipif(INTERPRETED, reason="Triton interpreter has no bf16 tl.dot")


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(USE_CUDA, reason="compiled on the GPU, not interpreted")
def test_kernels_run_interpreted_in_this_process():
    """conftest.py sets TRITON_INTERPRET=1 before anything imports triton; if something imported it earlier,
    the kernels would be compiled for a GPU there is not, and every kernel test below would fail."""
    assert not TRITON_IMPORTED_TOO_EARLY
    assert os.environ["TRITON_INTERPRET"] == "1"


# The interpreter runs kernels as NumPy code and misses compile-only errors, so
# compile them for Hopper (sm_90) with triton's bundled ptxas; no GPU needed.
# It runs in a subprocess because this process has TRITON_INTERPRET=1.
SM90_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.decode_attention import _combine_splits_kernel, _decode_split_kernel
from kernels.prefill_attention import _prefill_kernel
from kernels.reshape_and_cache import _reshape_and_cache_kernel

def compile_for_sm90(kernel, dtype, **constants):
    types = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
             "slot_mapping_ptr": "*i64", "split_out_ptr": "*fp32", "split_max_ptr": "*fp32",
             "split_sum_ptr": "*fp32", "scale": "fp32", "softcap": "fp32", "sinks_ptr": "*fp32"}
    names = kernel.arg_names
    # other pointers hold the attention dtype; other scalars (strides, counts) are i32
    signature = {name: types.get(name, "*" + dtype if name.endswith("_ptr") else "i32") for name in names}
    signature.update(dict.fromkeys(constants, "constexpr"))
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))

for dtype, head_dim in (("fp16", 128), ("bf16", 64), ("fp32", 64)):
    for variants in (False, True):  # plain, and with window + soft-cap + sinks
        flags = dict(USE_WINDOW=variants, USE_SOFTCAP=variants, USE_SINKS=variants)
        for num_splits in (1, 4):
            compile_for_sm90(_decode_split_kernel, dtype, QUERIES_PER_KV=4, HEAD_GROUP=16, BLOCK_SIZE=16,
                             HEAD_DIM=head_dim, TILE_N=64, NUM_SPLITS=num_splits, **flags)
        compile_for_sm90(_combine_splits_kernel, dtype, HEAD_DIM=head_dim, NUM_SPLITS=5, SPLITS_POW2=8,
                         USE_SINKS=variants)
        compile_for_sm90(_prefill_kernel, dtype, QUERIES_PER_KV=4, BLOCK_SIZE=16, HEAD_DIM=head_dim, BLOCK_M=64,
                         TILE_N=64, **flags)
    compile_for_sm90(_reshape_and_cache_kernel, dtype, BLOCK_SIZE=32, HEAD_DIM=head_dim)
"""


@pytest.mark.skipif(USE_CUDA, reason="the kernels are compiled and run on the GPU by the other tests")
def test_kernels_compile_for_sm90():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SM90_COMPILE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-5000:]


def assert_close(actual, expected):
    atol, rtol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def make_caches(block_size, num_kv_heads, head_dim, dtype):
    """Caches full of NaN, so that reading any slot not written by fill_context
    (or by the test) poisons the output."""
    shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    return key_cache, value_cache


def make_block_tables(seq_lens, block_size, generator):
    """Give each sequence distinct blocks scattered at random through the pool;
    unused entries point at block 0, whose NaN slots must never be read."""
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1
    assert sum(blocks_needed) <= len(pool), "test sequences do not fit the block pool"
    table = torch.zeros(len(seq_lens), max(blocks_needed) + 1, dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks_needed):
        table[i, :count] = pool[start : start + count]
        start += count
    return table.to(DEVICE)


def fill_context(key_cache, value_cache, block_tables, seq_lens, generator):
    """Write random keys/values for every sequence's tokens 0..seq_len-1 via the reference."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    for i, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len, device=DEVICE)
        slots = block_tables[i, positions // block_size].long() * block_size + positions % block_size
        shape = (seq_len, num_kv_heads, head_dim)
        key = torch.randn(shape, generator=generator).to(DEVICE, key_cache.dtype)
        value = torch.randn(shape, generator=generator).to(DEVICE, key_cache.dtype)
        reference.reshape_and_cache(key, value, key_cache, value_cache, slots)


def random_tensor(shape, dtype, generator):
    return torch.randn(shape, generator=generator).to(DEVICE, dtype)


# ---------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize(
    "block_size, head_dim, num_kv_heads, dtype",
    [
        (16, 64, 2, torch.float32),
        (32, 128, 1, torch.float16),
        (16, 128, 4, torch.bfloat16),
    ],
)
def test_reshape_and_cache_matches_reference(block_size, head_dim, num_kv_heads, dtype):
    generator = torch.Generator().manual_seed(0)
    num_tokens = 40
    shape = (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    key_cache = random_tensor(shape, dtype, generator)
    value_cache = random_tensor(shape, dtype, generator)
    # key and value as strided views into one packed [tokens, 2 * kv_heads, head_dim] tensor
    packed = random_tensor((num_tokens, 2 * num_kv_heads, head_dim), dtype, generator)
    key, value = packed[:, :num_kv_heads], packed[:, num_kv_heads:]
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=generator)[:num_tokens]
    slots[::7] = -1  # padding tokens
    slots = slots.to(DEVICE)

    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_key, expected_value, slots)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_key)
    assert torch.equal(value_cache, expected_value)


# ---------------------------------------------------------------- decode attention

DECODE_CASES = [
    # block_size, head_dim, num_kv_heads, queries_per_kv, dtype, num_splits
    (16, 64, 2, 1, torch.float32, 1),
    (16, 128, 2, 4, torch.float16, 1),
    (32, 64, 1, 8, torch.float16, None),  # MQA, automatic split choice
    (32, 128, 2, 8, torch.float32, 3),  # split-K
    (16, 64, 2, 4, torch.float32, 5),  # split-K with empty splits for short sequences
    (16, 64, 4, 1, torch.float16, 2),
    (16, 16, 2, 4, torch.float32, 2),  # head_dim 16, as in the engine's tiny test models
    pytest.param(16, 128, 2, 4, torch.bfloat16, 2, marks=NEEDS_BF16_DOT),
]


@pytest.mark.parametrize("block_size, head_dim, num_kv_heads, queries_per_kv, dtype, num_splits", DECODE_CASES)
def test_decode_attention_matches_reference(block_size, head_dim, num_kv_heads, queries_per_kv, dtype, num_splits):
    generator = torch.Generator().manual_seed(1)
    # one token, exactly one block, a partial block, several blocks plus a partial one
    seq_lens = [1, block_size, block_size + 5, 5 * block_size + 3]
    key_cache, value_cache = make_caches(block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(seq_lens, block_size, generator)
    fill_context(key_cache, value_cache, block_tables, seq_lens, generator)
    query = random_tensor((len(seq_lens), num_kv_heads * queries_per_kv, head_dim), dtype, generator)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    out = kernels.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, num_splits)
    expected = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, expected)


def test_decode_attention_empty_context_gives_zeros():
    generator = torch.Generator().manual_seed(2)
    key_cache, value_cache = make_caches(16, 1, 64, torch.float32)
    block_tables = make_block_tables([16], 16, generator)
    fill_context(key_cache, value_cache, block_tables, [16], generator)
    query = random_tensor((2, 2, 64), torch.float32, generator)
    seq_lens = torch.tensor([0, 16], dtype=torch.int32, device=DEVICE)
    block_tables = block_tables.expand(2, -1).contiguous()
    for num_splits in (1, 2):
        out = kernels.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, 0.125, num_splits)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isfinite(out[1]).all()


def test_choose_num_splits():
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 8, 4096, cpu) > 1  # one long sequence: split the context
    assert choose_num_splits(256, 8, 4096, cpu) == 1  # large batch fills the GPU alone
    assert choose_num_splits(1, 8, 100, cpu) == 1  # too short to be worth splitting
    assert choose_num_splits(1, 1, 1 << 20, cpu) <= 16


# ---------------------------------------------------------------- prefill attention

PREFILL_CASES = [
    # block_size, head_dim, num_kv_heads, queries_per_kv, dtype
    (16, 64, 2, 1, torch.float32),
    (32, 128, 1, 4, torch.float16),
    (16, 128, 2, 8, torch.float16),
    (16, 16, 2, 4, torch.float32),
    pytest.param(32, 64, 2, 4, torch.bfloat16, marks=NEEDS_BF16_DOT),
]


@pytest.mark.parametrize("block_size, head_dim, num_kv_heads, queries_per_kv, dtype", PREFILL_CASES)
def test_prefill_attention_mixed_batch(block_size, head_dim, num_kv_heads, queries_per_kv, dtype):
    generator = torch.Generator().manual_seed(3)
    # (cached prefix, new tokens): prefill over a cached prefix spanning two query tiles,
    # fresh prefill, decode, fresh single token, and a sequence with no new tokens.
    batch = [(30, 70), (0, 2 * block_size + 7), (3 * block_size + 1, 1), (0, 1), (block_size, 0)]
    seq_lens = [prefix + new for prefix, new in batch]
    key_cache, value_cache = make_caches(block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(seq_lens, block_size, generator)
    fill_context(key_cache, value_cache, block_tables, seq_lens, generator)
    num_heads = num_kv_heads * queries_per_kv
    total_q = sum(new for _, new in batch)
    packed_qkv = random_tensor((total_q, num_heads + 2 * num_kv_heads, head_dim), dtype, generator)
    query = packed_qkv[:, :num_heads]  # strided view, as after a fused QKV projection
    cu_seqlens_q = torch.tensor([0] + [new for _, new in batch], device=DEVICE).cumsum(0).int()
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    out = kernels.paged_prefill_attention(*args)
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, reference.paged_prefill_attention(*args))


def test_prefill_attention_random_batch():
    """Many sequences of random prefix and query lengths (0 included): checks how
    query tiles are mapped to sequences."""
    generator = torch.Generator().manual_seed(5)
    block_size, num_kv_heads, head_dim, dtype = 16, 1, 32, torch.float32
    prefixes = torch.randint(0, 40, (12,), generator=generator).tolist()
    q_lens = torch.randint(0, 70, (12,), generator=generator).tolist()
    q_lens[:3] = [0, 1, 65]
    seq_lens = [prefix + new for prefix, new in zip(prefixes, q_lens)]
    key_cache, value_cache = make_caches(block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(seq_lens, block_size, generator)
    fill_context(key_cache, value_cache, block_tables, seq_lens, generator)
    query = random_tensor((sum(q_lens), 2, head_dim), dtype, generator)
    cu_seqlens_q = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).int()
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, 0.2)
    assert_close(kernels.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))


def test_prefill_after_reshape_and_cache_matches_decode():
    """Write new tokens with the kernel, then check a decode row of a prefill batch
    against the decode kernel with split-K."""
    generator = torch.Generator().manual_seed(4)
    block_size, num_kv_heads, head_dim, dtype = 16, 2, 64, torch.float32
    batch = [(20, 9), (40, 1)]  # (cached prefix, new tokens)
    seq_lens = [prefix + new for prefix, new in batch]
    key_cache, value_cache = make_caches(block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(seq_lens, block_size, generator)
    fill_context(key_cache, value_cache, block_tables, [prefix for prefix, _ in batch], generator)

    slots = []
    for i, (prefix, new) in enumerate(batch):
        positions = torch.arange(prefix, prefix + new, device=DEVICE)
        slots.append(block_tables[i, positions // block_size].long() * block_size + positions % block_size)
    slots = torch.cat(slots)
    key = random_tensor((len(slots), num_kv_heads, head_dim), dtype, generator)
    value = random_tensor((len(slots), num_kv_heads, head_dim), dtype, generator)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)

    query = random_tensor((len(slots), 4 * num_kv_heads, head_dim), dtype, generator)
    cu_seqlens_q = torch.tensor([0, 9, 10], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, 0.1)
    prefill = kernels.paged_prefill_attention(*args)
    decode = kernels.paged_decode_attention(
        query[cu_seqlens_q[1:] - 1], key_cache, value_cache, block_tables, seq_lens, 0.1, num_splits=2
    )
    assert_close(prefill[cu_seqlens_q[1:] - 1], decode)
    assert_close(prefill, reference.paged_prefill_attention(*args))


# ---------------------------------------------------------------- windows, soft-capping, sinks

VARIANT_CASES = [
    # sliding_window, softcap, sinks, num_splits (decode)
    (8, None, False, 1),  # window smaller than a tile and than most contexts
    (70, None, False, 3),  # window spanning tiles, split-K over the window only
    (None, 5.0, False, 1),  # soft-capping alone (Gemma 2: logits squashed into (-5, 5))
    (None, None, True, 2),  # sinks, added once in the combine pass
    (8, 5.0, True, 1),  # all three, sinks in the single split
]


def null_blocks_outside_window(block_tables, seq_lens, block_size, window):
    """The engine's freed blocks: entries wholly before every query's window point at NaN block 0."""
    tables = block_tables.clone()
    for i, seq_len in enumerate(seq_lens):
        tables[i, : max(0, seq_len - window) // block_size] = 0
    return tables


def variant_args(sliding_window, softcap, sinks, num_heads, generator):
    sinks = random_tensor((num_heads,), torch.float32, generator) * 2 if sinks else None
    return dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("sliding_window, softcap, sinks, num_splits", VARIANT_CASES)
def test_decode_attention_variants_match_reference(sliding_window, softcap, sinks, num_splits):
    generator = torch.Generator().manual_seed(6)
    block_size, num_kv_heads, queries_per_kv, head_dim, dtype = 8, 2, 4, 16, torch.float32
    seq_lens = [1, 8, 9, 30, 150]
    key_cache, value_cache = make_caches(block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(seq_lens, block_size, generator)
    fill_context(key_cache, value_cache, block_tables, seq_lens, generator)
    query = random_tensor((len(seq_lens), num_kv_heads * queries_per_kv, head_dim), dtype, generator) * 3
    variants = variant_args(sliding_window, softcap, sinks, num_kv_heads * queries_per_kv, generator)
    kernel_tables = block_tables
    if sliding_window is not None:
        kernel_tables = null_blocks_outside_window(block_tables, seq_lens, block_size, sliding_window)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    out = kernels.paged_decode_attention(query, key_cache, value_cache, kernel_tables, seq_lens, 0.25, num_splits,
                                         **variants)
    expected = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, 0.25,
                                                **variants)
    assert_close(out, expected)
    plain = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, 0.25)
    assert not torch.allclose(expected, plain, atol=1e-3)  # the variant changes the result


@pytest.mark.parametrize("sliding_window, softcap, sinks, num_splits", VARIANT_CASES)
def test_prefill_attention_variants_match_reference(sliding_window, softcap, sinks, num_splits):
    generator = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, queries_per_kv, head_dim, dtype = 8, 2, 2, 16, torch.float32
    batch = [(30, 70), (0, 21), (17, 1), (0, 1), (60, 9)]  # (cached prefix, new tokens)
    seq_lens = [prefix + new for prefix, new in batch]
    key_cache, value_cache = make_caches(block_size, num_kv_heads, head_dim, dtype)
    block_tables = make_block_tables(seq_lens, block_size, generator)
    fill_context(key_cache, value_cache, block_tables, seq_lens, generator)
    num_heads = num_kv_heads * queries_per_kv
    query = random_tensor((sum(new for _, new in batch), num_heads, head_dim), dtype, generator) * 3
    variants = variant_args(sliding_window, softcap, sinks, num_heads, generator)
    kernel_tables = block_tables
    if sliding_window is not None:  # blocks before the first query's window are never read
        kernel_tables = null_blocks_outside_window(block_tables, [p + 1 for p, _ in batch], block_size,
                                                   sliding_window)
    cu_seqlens_q = torch.tensor([0] + [new for _, new in batch], device=DEVICE).cumsum(0).int()
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    out = kernels.paged_prefill_attention(query, key_cache, value_cache, kernel_tables, cu_seqlens_q, seq_lens,
                                          0.25, **variants)
    expected = reference.paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q,
                                                  seq_lens, 0.25, **variants)
    assert_close(out, expected)


def test_variant_arguments_are_checked():
    args = valid_decode_args()
    for change, message in [(dict(sliding_window=0), "sliding_window must be"), (dict(softcap=0.0), "softcap"),
                            (dict(sinks=torch.zeros(3, device=DEVICE)), "one logit per query head")]:
        with pytest.raises(ValueError, match=message):
            kernels.paged_decode_attention(**args, **change)


# ---------------------------------------------------------------- input validation


NON_CONTIGUOUS_CACHE = torch.zeros(4, 2, 16, 64).transpose(1, 2)


def valid_decode_args():
    key_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    return dict(
        query=torch.zeros(3, 8, 64, device=DEVICE),
        key_cache=key_cache,
        value_cache=torch.zeros_like(key_cache),
        block_tables=torch.zeros(3, 2, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.ones(3, dtype=torch.int32, device=DEVICE),
        scale=0.125,
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(query=torch.zeros(3, 3, 64)), r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"),
        (dict(query=torch.zeros(3, 8, 128)), "query head_dim 128 does not match the cache head_dim 64"),
        (dict(query=torch.zeros(3, 8, 64, dtype=torch.float16)), "query dtype .* does not match"),
        (dict(query=torch.zeros(3, 8)), "query must have 3 dimensions"),
        (dict(value_cache=torch.zeros(4, 16, 1, 64)), "key_cache and value_cache shapes differ"),
        (dict(key_cache=torch.zeros(4, 16, 2, 48), value_cache=torch.zeros(4, 16, 2, 48)), "power of two"),
        (dict(key_cache=NON_CONTIGUOUS_CACHE, value_cache=NON_CONTIGUOUS_CACHE), "must be contiguous"),
        (dict(block_tables=torch.zeros(3, 2, dtype=torch.int64)), "block_tables must have dtype torch.int32"),
        (dict(seq_lens=torch.ones(2, dtype=torch.int32)), "expected 3 sequences"),
        (dict(num_splits=0), "num_splits must be >= 1"),
    ],
)
def test_decode_attention_rejects_bad_input(change, message):
    args = valid_decode_args()
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    with pytest.raises(ValueError, match=message):
        kernels.paged_decode_attention(**args)


def test_prefill_attention_rejects_bad_input():
    args = valid_decode_args()
    caches = args["key_cache"], args["value_cache"]
    query = torch.zeros(5, 8, 64, device=DEVICE)
    cu_seqlens_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)  # 2 sequences, tables have 3
    with pytest.raises(ValueError, match="expected 2 sequences"):
        kernels.paged_prefill_attention(query, *caches, args["block_tables"], cu_seqlens_q, args["seq_lens"], 0.1)
    with pytest.raises(ValueError, match="cu_seqlens_q must have dtype torch.int32"):
        kernels.paged_prefill_attention(query, *caches, args["block_tables"][:2], cu_seqlens_q.long(),
                                        args["seq_lens"][:2], 0.1)


def test_reshape_and_cache_rejects_bad_input():
    key_cache = torch.zeros(4, 16, 2, 64, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must have dtype torch.int64"):
        kernels.reshape_and_cache(key, key, key_cache, value_cache, slots.int())
    with pytest.raises(ValueError, match=r"value must have shape \(3, 2, 64\)"):
        kernels.reshape_and_cache(key, key[:, :1], key_cache, value_cache, slots)
    with pytest.raises(ValueError, match="key dtype torch.float16 does not match"):
        kernels.reshape_and_cache(key.half(), key, key_cache, value_cache, slots)
