"""The torch paged decode attention (the CPU path): grouped gathers into a reused workspace give the same
output as the per-sequence reference, whatever the group size and however the batch shape changes."""

from __future__ import annotations

import pytest
import torch

from backend.attention import GatherWorkspace, decode_attention, torch_sdpa
from kernels import reference

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM = 64, 4, 2, 6, 8


def decode_inputs(seq_lens: list[int], seed: int, head_dim: int = HEAD_DIM, num_heads: int = NUM_HEADS,
                  block_size: int = BLOCK_SIZE, num_blocks: int = NUM_BLOCKS):
    """Random pool, scattered block tables padded with block 0, and the engine's key mask."""
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen)
    max_blocks = -(-max(seq_lens) // block_size)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    for i, n in enumerate(seq_lens):
        used = -(-n // block_size)
        tables[i, :used] = torch.tensor([order.pop() for _ in range(used)])
    lens = torch.tensor(seq_lens)
    mask = (torch.arange(max_blocks * block_size)[None, :] < lens[:, None])[:, None, None, :]
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    return query, key_cache, value_cache, tables, lens, mask


@pytest.mark.parametrize("group_blocks", [1, 3, 7, 10_000])  # bytes of one block: groups of one sequence
def test_grouped_decode_attention_matches_the_reference(monkeypatch, group_blocks):
    block_bytes = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    monkeypatch.setattr(torch_sdpa, "DECODE_GROUP_BYTES", group_blocks * block_bytes)
    workspace = GatherWorkspace()
    for seed, seq_lens in enumerate([[1, 5, 17, 9, 4, 12, 3], [30, 2], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]]):
        query, key_cache, value_cache, tables, lens, mask = decode_inputs(seq_lens, seed)
        out = decode_attention(query, key_cache, value_cache, tables, mask, 0.3, workspace)
        expected = reference.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.3)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_workspace_grows_and_is_reused():
    workspace = GatherWorkspace()
    like = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    small = workspace.get(0, like, 3)
    assert small.shape == (3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    assert workspace.get(0, like, 2) is small  # big enough: the same buffer
    assert workspace.get(1, like, 2) is not small  # values have their own
    bigger = workspace.get(0, like, 5)
    assert bigger.shape[0] == 5 and workspace.get(0, like, 4) is bigger


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 64, 128])  # 64 and 128 take the tiled kernel in fp32 and bf16
def test_cpu_kernel_reads_blocks_in_place_like_the_reference(dtype, head_dim):
    """kernels/cpu's decode attention (compiled here) equals the per-sequence reference over scattered blocks,
    GQA, and context lengths from one token to several 16-token tiles, tiles straddling blocks; a batch of 8
    (all KV heads of a sequence in one task) and of 2 (one task per KV head)."""
    import kernels.cpu

    if kernels.cpu.load() is None:
        pytest.skip("no C++ compiler on this machine")
    for seq_lens in ([1, 3, 4, 5, 16, 17, 30, 49], [33, 2]):
        _check_cpu_kernel(seq_lens, dtype, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_cpu_kernel_reads_nothing_past_a_sequences_last_token(dtype, head_dim):
    """NaN in the slots after each sequence's last token changes nothing: the tiled kernel's rows past a tile's end
    repeat the tile's last key and value (their score lanes masked), never the slots themselves; a value row read
    there, even with weight 0, would make the output NaN."""
    import kernels.cpu

    if kernels.cpu.load() is None:
        pytest.skip("no C++ compiler on this machine")
    for seq_lens in ([1, 3, 4, 5, 16, 17, 30, 49], [33, 2], [47, 100]):
        _check_cpu_kernel(seq_lens, dtype, head_dim, poison_tails=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])  # query heads per KV head: the kernel takes them up to 4 at a time
def test_cpu_kernel_covers_every_query_group_size(dtype, head_dim, group):
    import kernels.cpu

    if kernels.cpu.load() is None:
        pytest.skip("no C++ compiler on this machine")
    _check_cpu_kernel([1, 17, 40, 9, 33, 2, 16, 64], dtype, head_dim, num_heads=group * NUM_KV_HEADS)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_cpu_kernel_scores_bf16_on_amx_tiles_like_the_reference(block_size, head_dim, group):
    """bf16 with blocks of whole 16-token tiles takes the AMX kernel where the CPU has AMX (keys loaded as tiles
    from the blocks, every query head of a task in one score tile): the same results as the reference, for
    contexts ending anywhere in a tile, tasks of one KV head (batch 2) and of all of them (batch 8)."""
    import kernels.cpu

    if kernels.cpu.load() is None:
        pytest.skip("no C++ compiler on this machine")
    for seq_lens in ([1, 15, 16, 17, 31, 33, 64, 100], [47, 2]):
        _check_cpu_kernel(seq_lens, torch.bfloat16, head_dim, num_heads=group * NUM_KV_HEADS, block_size=block_size)


def _check_cpu_kernel(seq_lens: list[int], dtype: torch.dtype, head_dim: int, num_heads: int = NUM_HEADS,
                      block_size: int = BLOCK_SIZE, poison_tails: bool = False) -> None:
    import kernels.cpu

    num_blocks = max(NUM_BLOCKS, 4 * 112 // block_size * 8)
    query, key_cache, value_cache, tables, lens, _ = decode_inputs(seq_lens, seed=3, head_dim=head_dim,
                                                                   num_heads=num_heads, block_size=block_size,
                                                                   num_blocks=num_blocks)
    query, key_cache, value_cache = query.to(dtype), key_cache.to(dtype), value_cache.to(dtype)
    if poison_tails:  # the slots after each sequence's last token hold NaN (the reference slices them off)
        for i, n in enumerate(seq_lens):
            last = tables[i, (n - 1) // block_size]
            key_cache[last, (n - 1) % block_size + 1:] = float("nan")
            value_cache[last, (n - 1) % block_size + 1:] = float("nan")
    got = kernels.cpu.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.3)
    # The same queries read in place as the compact decoder passes them, a view of the fused QKV rows whose K and V
    # columns (NaN here) must not be read: the same output, bit for bit.
    fused = torch.full((len(seq_lens), (num_heads + 2 * NUM_KV_HEADS) * head_dim), float("nan"), dtype=dtype)
    fused[:, :num_heads * head_dim] = query.reshape(len(seq_lens), -1)
    in_place = torch.empty_like(got)
    kernels.cpu._module().paged_decode_attention(in_place, fused[:, :num_heads * head_dim].view(query.shape),
                                                 key_cache, value_cache, tables, lens, 0.3)
    assert torch.equal(in_place, got)
    for i, n in enumerate(seq_lens):
        keys = key_cache[tables[i]].reshape(-1, NUM_KV_HEADS, head_dim)[:n].float()
        values = value_cache[tables[i]].reshape(-1, NUM_KV_HEADS, head_dim)[:n].float()
        q = query[i].float().view(NUM_KV_HEADS, num_heads // NUM_KV_HEADS, head_dim)
        scores = torch.einsum("hgd,thd->hgt", q, keys) * 0.3
        want = torch.einsum("hgt,thd->hgd", scores.softmax(-1), values).reshape(num_heads, head_dim)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[i].float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype,block_size", [(torch.float32, BLOCK_SIZE), (torch.bfloat16, BLOCK_SIZE),
                                              (torch.bfloat16, 16), (torch.bfloat16, 32)])  # bf16, 16 | block: AMX
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [3, 8])  # query heads per KV head: a task's 16 columns span rows
def test_cpu_prefill_kernel_is_causal_over_prefix_and_new_rows_like_the_reference(dtype, block_size, head_dim, group):
    """kernels/cpu's prefill attention (several sequences in one call) equals a per-sequence causal softmax over
    scattered blocks: whole prompts, chunks after a cached prefix (rows start past position 0), row counts
    around the kernel's 16-row blocks, one-row chunks, GQA."""
    import kernels.cpu

    if kernels.cpu.load() is None:
        pytest.skip("no C++ compiler on this machine")
    gen = torch.Generator().manual_seed(7)
    q_lens, seq_lens = [1, 5, 16, 17, 40, 3, 33], [1, 5, 16, 30, 40, 64, 50]  # seq_len - q_len: cached prefix
    num_heads = group * NUM_KV_HEADS
    _, key_cache, value_cache, tables, _, _ = decode_inputs(seq_lens, seed=5, head_dim=head_dim, block_size=block_size,
                                                            num_blocks=max(NUM_BLOCKS, 4 * 64 // block_size * 8))
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    # q as the compact decoder has it: a view of the fused QKV output (rows padded by the K and V columns)
    qkv = torch.randn(sum(q_lens), (num_heads + 2 * NUM_KV_HEADS) * head_dim, generator=gen).to(dtype)
    query = qkv[:, :num_heads * head_dim].view(sum(q_lens), num_heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    out = torch.full((sum(q_lens), num_heads, head_dim), float("nan"), dtype=dtype)
    assert kernels.cpu.paged_prefill_attention(query, key_cache, value_cache, tables, cu, torch.tensor(seq_lens),
                                               0.3, out=out)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (n, total) in enumerate(zip(q_lens, seq_lens)):
        keys = key_cache[tables[i]].reshape(-1, NUM_KV_HEADS, head_dim)[:total].float()
        values = value_cache[tables[i]].reshape(-1, NUM_KV_HEADS, head_dim)[:total].float()
        q = query[cu[i]:cu[i + 1]].float().view(n, NUM_KV_HEADS, group, head_dim)
        scores = torch.einsum("rhgd,thd->rhgt", q, keys) * 0.3
        visible = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]  # [rows, keys]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        want = torch.einsum("rhgt,thd->rhgd", scores.softmax(-1), values).reshape(n, num_heads, head_dim)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].float(), want, atol=tolerance, rtol=tolerance)


def test_cpu_prefill_kernel_declines_shapes_it_does_not_cover():
    """Head dims other than 64/128 and fp16 are left to gather + SDPA: the kernel says so and writes nothing."""
    import kernels.cpu

    if kernels.cpu.load() is None:
        pytest.skip("no C++ compiler on this machine")
    for head_dim, dtype in [(8, torch.float32), (64, torch.float16)]:
        query, key_cache, value_cache, tables, lens, _ = decode_inputs([5, 9], seed=1, head_dim=head_dim)
        q = query.repeat(7, 1, 1)[:14].to(dtype)  # 5 + 9 rows
        out = torch.zeros_like(q)
        assert not kernels.cpu.paged_prefill_attention(q, key_cache.to(dtype), value_cache.to(dtype), tables,
                                                       torch.tensor([0, 5, 14]), lens, 0.3, out=out)
        assert not out.any()


def _bad_decode_inputs():
    q, k, v, tables, lens, _ = decode_inputs([5, 9], seed=2, head_dim=64, block_size=16)
    return {
        "out of another dtype": dict(out=torch.empty_like(q, dtype=torch.bfloat16)),
        "out with fewer rows": dict(out=torch.empty_like(q[:1])),
        "value_cache of another dtype": dict(value_cache=v.bfloat16()),
        "value_cache with fewer blocks": dict(value_cache=v[:2].contiguous()),
        "fewer block table rows than sequences": dict(q=q.repeat(2, 1, 1), seq_lens=lens.repeat(2)),
        "fewer seq_lens than sequences": dict(seq_lens=lens[:1]),
        "a seq_len past the block table": dict(seq_lens=torch.tensor([5, 100_000])),
        "a negative seq_len": dict(seq_lens=torch.tensor([5, -1])),
        "a block id past the cache": dict(block_tables=torch.full_like(tables, NUM_BLOCKS)),
    }, dict(q=q, key_cache=k, value_cache=v, block_tables=tables, seq_lens=lens, scale=0.1)


@pytest.mark.parametrize("case", list(_bad_decode_inputs()[0]))
def test_cpu_kernels_refuse_what_they_would_read_out_of_bounds(case):
    """Each of these crashed the process or read past a tensor (a segfault, heap corruption, NaN); the kernels check
    every table entry and length they will read before reading, and raise."""
    import kernels.cpu

    if kernels.cpu.load() is None:
        pytest.skip("no C++ compiler on this machine")
    bad, good = _bad_decode_inputs()
    with pytest.raises(RuntimeError):
        kernels.cpu.paged_decode_attention(**{**good, **bad[case]})
    kernels.cpu.paged_decode_attention(**good)  # the good inputs run


@pytest.mark.parametrize("cu_seqlens, rows", [([0, 2, 9], 3), ([0, 3, 2], 4), ([0, 8, 10], 10), ([1, 3, 5], 5)])
def test_cpu_prefill_kernel_refuses_rows_it_would_read_out_of_bounds(cu_seqlens, rows):
    """cu_seqlens past q's rows, decreasing, more rows than a sequence's context (5), or not starting at 0."""
    import kernels.cpu

    if kernels.cpu.load() is None:
        pytest.skip("no C++ compiler on this machine")
    _, key_cache, value_cache, tables, lens, _ = decode_inputs([5, 9], seed=3, head_dim=64, block_size=16)
    q = torch.randn(rows, NUM_HEADS, 64)
    with pytest.raises(RuntimeError):
        kernels.cpu.paged_prefill_attention(q, key_cache, value_cache, tables, torch.tensor(cu_seqlens), lens, 0.1,
                                            out=torch.empty_like(q))
