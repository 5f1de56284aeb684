"""The C++ layer kernels of kernels/cpu against the arithmetic of transformers' own modules.

Each kernel rounds where transformers rounds, so in bf16 the results equal transformers' (rotary bit for bit;
the norms up to the last bit of an fp32 sum) and in fp32 they agree to rounding.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import kernels.cpu

pytestmark = pytest.mark.skipif(kernels.cpu.load() is None, reason="no C++ compiler for kernels/cpu")
DTYPES = [torch.float32, torch.bfloat16]


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(weight.dtype)
    norm.weight.data.copy_(weight)
    return norm(x)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # equal but for values where an fp32 sum's last bit moves the bf16 rounding: one bf16 step at most
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_equals_transformers(dtype):
    torch.manual_seed(0)
    x = (torch.randn(37, 96) * 3).to(dtype)
    weight = (torch.rand(96) + 0.5).to(dtype)
    _close(kernels.cpu.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_rms_norm_in_place_on_a_strided_view(dtype):
    """Qwen3's q norm: heads of a fused QKV row, normalized in place; the K/V columns are left alone."""
    torch.manual_seed(1)
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16).to(dtype)
    before = qkv.clone()
    q = qkv[:, :64].view(5, 4, 16)
    weight = (torch.rand(16) + 0.5).to(dtype)
    want = _hf_rms_norm(before[:, :64].view(5, 4, 16), weight, 1e-6)
    kernels.cpu.rms_norm(q, weight, 1e-6, out=q)
    _close(qkv[:, :64].view(5, 4, 16), want, dtype)
    assert torch.equal(qkv[:, 64:], before[:, 64:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_the_residual_and_normalizes_it(dtype):
    torch.manual_seed(2)
    x, residual = torch.randn(19, 64).to(dtype), torch.randn(19, 64).to(dtype)
    weight = (torch.rand(64) + 0.5).to(dtype)
    want_residual = residual + x
    want = _hf_rms_norm(want_residual, weight, 1e-5)
    kernels.cpu.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, want_residual)  # one rounding, as eager torch's add
    _close(x, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_the_fused_qkv_output_equals_transformers(dtype):
    torch.manual_seed(3)
    tokens, heads, kv_heads, head_dim = 7, 6, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    before = qkv.clone()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2) * 50
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None].clone(), k.transpose(0, 1)[None].clone(),
                                          cos[None], sin[None])
    kernels.cpu.rotary_embedding(q, k, cos, sin)
    if dtype == torch.float32:  # the compiler may fuse a multiply and an add: one rounding fewer
        torch.testing.assert_close(q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(q, want_q[0].transpose(0, 1)) and torch.equal(k, want_k[0].transpose(0, 1))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_swiglu(dtype):
    torch.manual_seed(4)
    gate_up = (torch.randn(11, 2 * 80) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # sigmoid's saturated ends and zero
    want = F.silu(gate_up[:, :80]) * gate_up[:, 80:]
    _close(kernels.cpu.silu_and_mul(gate_up), want, dtype)


def test_kernels_reject_mismatched_shapes():
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernels.cpu.rms_norm(torch.randn(4, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        kernels.cpu._module().silu_and_mul(torch.empty(4, 5), torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="rotary_embedding"):  # heads of no width: an error, not SIGFPE
        kernels.cpu.rotary_embedding(torch.empty(4, 2, 0), torch.empty(4, 1, 0), torch.empty(4, 0), torch.empty(4, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_reads_the_models_dtype_and_breaks_ties_to_the_first_index(dtype):
    torch.manual_seed(5)
    logits = (torch.randn(9, 1000) * 4).to(dtype)
    logits[0, [7, 500, 999]] = 50.0  # a tie: the first wins
    logits[1] = float("-inf")
    logits[1, 321] = -3.0  # everything else masked
    logits[2, -1] = 60.0  # the last column
    got = kernels.cpu.argmax(logits)
    assert got.tolist() == logits.float().argmax(-1).tolist()
    assert got[0] == 7 and got[1] == 321 and got[2] == 999


def test_a_lock_left_by_a_killed_build_does_not_block_loading():
    """torch's build lock file outlives a process killed while holding it (a stub killed during start-up);
    loading must not wait on it forever."""
    import subprocess
    import sys

    module_file = Path(kernels.cpu.load().__file__)
    stale = module_file.parent / "lock"
    stale.touch()
    try:
        out = subprocess.run([sys.executable, "-c", "import kernels.cpu; assert kernels.cpu.load() is not None"],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    finally:
        stale.unlink(missing_ok=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_puts_each_row_at_its_slot_and_skips_padding(dtype):
    """K and V read in place from a fused QKV output (strided rows) land where index_copy_ puts them; a slot of
    -1 writes nothing; transposed views are declined (the caller copies); a slot past the pool is an error. Rows
    of 3 x 16 fp32 are 3 whole cache lines (streaming stores), of bf16 one and a half (plain copies)."""
    torch.manual_seed(4)
    blocks, block_size, heads, dim, tokens = 9, 4, 3, 16, 7
    qkv = torch.randn(tokens, (6 + 2 * heads) * dim).to(dtype)
    k = qkv[:, 6 * dim:(6 + heads) * dim].view(tokens, heads, dim)
    v = qkv[:, (6 + heads) * dim:].view(tokens, heads, dim)
    slots = torch.tensor([5, 0, 35, -1, 17, 18, 2])
    key_cache, value_cache = (torch.zeros(blocks, block_size, heads, dim, dtype=dtype) for _ in range(2))
    assert kernels.cpu.write_kv(k, v, key_cache, value_cache, slots)
    want_k, want_v = (torch.zeros(blocks * block_size, heads, dim, dtype=dtype) for _ in range(2))
    kept = slots >= 0
    want_k.index_copy_(0, slots[kept], k[kept])
    want_v.index_copy_(0, slots[kept], v[kept])
    assert torch.equal(key_cache.view(-1, heads, dim), want_k) and torch.equal(value_cache.view(-1, heads, dim), want_v)
    transformers_k = torch.randn(1, heads, tokens, dim).to(dtype)[0].transpose(0, 1)  # [tokens, heads, dim] view
    assert not kernels.cpu.write_kv(transformers_k, v, key_cache, value_cache, slots)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.cpu.write_kv(k, v, key_cache, value_cache, torch.tensor([0, 1, 2, 3, 4, 5, blocks * block_size]))


def _mapping_kib(address: int, field: str) -> int:
    """``field`` (Rss, AnonHugePages, ...) of the mapping of this process that holds ``address``, in KiB."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if not head.endswith(":"):  # a mapping's first line: "start-end perms offset device inode [path]"
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == field + ":":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_kv_pool_is_zeroed_on_2_mib_pages_with_nothing_resident_past_it():
    """The CPU backend's pools: zeros of the shape and dtype asked for, contiguous, starting on a 2 MiB boundary;
    where the kernel's THP mode is ``madvise`` (the common default), the whole 2 MiB pages are resident huge pages
    from the start (every page touched, as ``torch.zeros`` does) and the part past the last one is on 4 KiB pages,
    so that nothing past the pool is resident."""
    from backend.attention.cpu import CPUBackend

    shape = (1000, 16, 3, 64)  # 5.9 MiB of bf16: two whole 2 MiB pages and a tail
    pool = CPUBackend.kv_pool(shape, torch.bfloat16, torch.device("cpu"))
    nbytes = pool.numel() * pool.element_size()
    assert pool.shape == shape and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert not pool.any() and pool.data_ptr() % (2 << 20) == 0
    if "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        # madvise splits the mapping: the whole pages' part, all of it resident on huge pages, and the tail's
        assert _mapping_kib(pool.data_ptr(), "AnonHugePages") == _mapping_kib(pool.data_ptr(), "Rss") == 2 * 2048
        assert _mapping_kib(pool.data_ptr() + nbytes - 1, "AnonHugePages") == 0
    small = CPUBackend.kv_pool((4, 16, 3, 64), torch.float32, torch.device("cpu"))  # under 2 MiB: torch's allocator
    assert small.shape == (4, 16, 3, 64) and not small.any()
    assert CPUBackend.kv_pool((0, 16, 3, 64), torch.float32, torch.device("cpu")).shape == (0, 16, 3, 64)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump (binutils) to read the built library")
def test_decode_attention_kernels_keep_their_software_prefetches():
    """The decode attention's kernels prefetch the KV rows two tiles ahead (blocks lie scattered, so the hardware
    prefetchers stop at each block's end). GCC may drop a ``__builtin_prefetch`` it considers free of side
    effects, and then the AMX kernel takes about 1.4x the time: every decode attention kernel in the built library
    holds prefetch instructions (the AMX ones where the compiler built them, ``tile_kernel`` everywhere)."""
    library = kernels.cpu.load().__file__
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True,
                             check=True).stdout
    prefetches: dict[str, int] = {}
    function = None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            kernel = re.search(r"\b(amx_decode_kernel|tile_kernel)<([^>]*)>", header.group(1))
            function = f"{kernel.group(1)}<{kernel.group(2)}>" if kernel else None
            if function:
                prefetches.setdefault(function, 0)
        elif function and "prefetch" in line:
            prefetches[function] += 1
    assert {"tile_kernel<float, 64>", "tile_kernel<float, 128>"} <= set(prefetches), sorted(prefetches)
    assert all(count > 0 for count in prefetches.values()), prefetches


@pytest.mark.skipif(not kernels.cpu.small_gemm_available(torch.float32), reason="no small_gemm for fp32 here")
def test_decode_layers_checks_every_layer_before_the_first_writes_its_kv_cache():
    """decode_layers stores each layer's K and V in the same pass as rotary, and its activations are allocated
    once for all layers: a slot past a later layer's (smaller) pool, or a later layer of other shapes, raises before
    the first layer writes anything; so do degenerate head shapes and fp16 activations."""
    torch.manual_seed(5)
    hidden_size, heads, kv_heads, dim, inter, rows, block_size = 64, 4, 2, 16, 96, 3, 16

    def layer(intermediate: int = inter, blocks: int = 4) -> list[torch.Tensor]:
        def packed(n: int, k: int) -> torch.Tensor:
            return kernels.cpu.small_gemm_pack(torch.randn(n, k) * 0.1)
        return [torch.ones(hidden_size), packed((heads + 2 * kv_heads) * dim, hidden_size), torch.empty(0),
                packed(hidden_size, heads * dim), torch.empty(0), torch.ones(hidden_size),
                packed(2 * intermediate, hidden_size), packed(hidden_size, intermediate),
                torch.zeros(blocks, block_size, kv_heads, dim), torch.zeros(blocks, block_size, kv_heads, dim)]

    theta = torch.rand(rows, dim // 2)
    cos, sin = torch.cat([theta.cos()] * 2, 1), torch.cat([theta.sin()] * 2, 1)
    tables, lens = torch.tensor([[0], [1], [2]]), torch.tensor([1, 1, 1])

    def run(layers: list[torch.Tensor], slots: list[int], hidden=None, heads_=heads, kv_heads_=kv_heads, dim_=dim):
        hidden = torch.randn(rows, hidden_size) if hidden is None else hidden
        return kernels.cpu.decode_layers(hidden, cos, sin, torch.tensor(slots), tables, lens, layers, heads_,
                                         kv_heads_, dim_, 1e-5, dim ** -0.5)

    good = layer() + layer()
    hidden, residual = run(good, [0, 16, 32])
    assert hidden.shape == residual.shape == (rows, hidden_size) and torch.isfinite(hidden).all()
    assert all(good[8][block, 0].abs().sum() > 0 for block in range(3))  # each row's key at its slot
    for layers, slots, match in ((layer() + layer(blocks=2), [0, 16, 40], "out of range"),
                                 (layer() + layer(inter + 16), [0, 16, 32], "GEMM widths differ")):
        with pytest.raises(RuntimeError, match=match):
            run(layers, slots)
        assert all(not t.any() for t in layers[8::10] + layers[9::10])  # no layer wrote its cache
    for bad in (dict(dim_=0), dict(kv_heads_=0), dict(heads_=3), dict(hidden=torch.randn(rows, hidden_size).half())):
        with pytest.raises(RuntimeError, match="decode_layers"):
            run(layer() + layer(), [0, 16, 32], **bad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 16, 17, 32, 33, 48, 64, 65, 203, 256, 301, 2050])
def test_small_gemm_equals_onednn_up_to_summation_order(dtype, rows):
    """The decode GEMM (bf16 on AMX or with AVX512-BF16 dot products, fp32 on AVX-512, both on AVX2) against an fp64
    reference and oneDNN's GEMM (what runs for larger batches; F.linear for bf16 where oneDNN has no bf16): full and partial 16-row tiles and 6-row blocks, 2 and 3 tiles
    of rows with several blocks of outputs per pass (and block counts that leave a remainder), many passes of rows
    over a group of outputs (while the next group is prefetched), a bias, K of one and of many tiles, output
    counts that are and are not multiples of 64; on AVX2 (every GEMM), rows in several panels and K in two chunks
    (1536 = 1024 + 512)."""
    if not kernels.cpu.small_gemm_available(dtype):
        pytest.skip(f"no small_gemm for {dtype} on this CPU (AMX, AVX512-BF16 (bf16), AVX-512 (fp32) or AVX2)")
    if rows > kernels.cpu.small_gemm_max_rows(dtype):
        pytest.skip(f"small_gemm takes at most {kernels.cpu.small_gemm_max_rows(dtype)} rows here (AMX, AVX2)")
    torch.manual_seed(rows)
    for n, k, with_bias in ((48, 32, False), (80, 64, True), (960, 576, True), (576, 1536, False)):
        weight = (torch.randn(n, k) * 0.05).to(dtype)
        x = torch.randn(rows, k).to(dtype)
        bias = (torch.randn(n) * 0.1).to(dtype) if with_bias else None
        got = kernels.cpu.small_gemm(x, kernels.cpu.small_gemm_pack(weight), bias)
        want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-3)  # one bf16 rounding
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                onednn = torch.ops.mkldnn._linear_pointwise(
                    x, torch.ops.mkldnn._reorder_linear_weight(weight, None), bias, "none", [], "")
            else:  # AVX2: no bf16 in oneDNN
                onednn = F.linear(x, weight, bias)
            assert (got != onednn).float().mean() < 1e-3


@pytest.mark.parametrize("rows", [7, 13, 100, 256])
def test_small_gemm_fp32_rows_do_not_depend_on_their_batch(rows):
    """fp32 prompts go through small_gemm in slices of rows (the model's numbers must not depend on what shares a
    step): a row's output is bit-identical alone and in a call of many rows, also where K runs in chunks (AVX-512:
    of 64 k past 1024 up to 96 rows; of 128 past 96 rows, in blocks of 4 groups of 64 outputs, 1040 = 4 full blocks
    and one group of 16; 2500 leaves a partial last chunk) and where the last group of outputs is short
    (80 = 64 + 16)."""
    if not kernels.cpu.small_gemm_available(torch.float32):
        pytest.skip("no fp32 small_gemm on this CPU (AVX-512 or AVX2)")
    torch.manual_seed(rows)
    for n, k in ((80, 1536), (64, 2500), (48, 512), (1040, 640)):
        packed = kernels.cpu.small_gemm_pack(torch.randn(n, k) * 0.05)
        bias = torch.randn(n)
        x = torch.randn(rows, k)
        got = kernels.cpu.small_gemm(x, packed, bias)
        alone = torch.cat([kernels.cpu.small_gemm(x[i:i + 1], packed, bias) for i in range(rows)])
        assert torch.equal(got, alone), (n, k)


@pytest.mark.parametrize("rows", [1, 5, 7, 17, 40, 64, 203])
def test_small_gemm_fp32_out_is_the_bf16_sums_before_their_rounding(rows):
    """bf16 rows with ``out_dtype`` fp32 (an LM head's logits): the same fp32 sums the bf16 result rounds, bit for
    bit, on every path (AMX tiles in one and several 16-row chunks, AVX512-BF16 blocks, AVX2's streamed rows and
    panels), and closer to the exact products than the bf16 result."""
    if not kernels.cpu.small_gemm_available(torch.bfloat16):
        pytest.skip("no bf16 small_gemm on this CPU (AMX, AVX512-BF16 or AVX2)")
    if rows > kernels.cpu.small_gemm_max_rows(torch.bfloat16):
        pytest.skip(f"small_gemm takes at most {kernels.cpu.small_gemm_max_rows(torch.bfloat16)} rows here (AMX)")
    torch.manual_seed(rows)
    for n, k, with_bias in ((80, 64, True), (960, 576, False), (576, 1536, True)):
        weight = (torch.randn(n, k) * 0.05).bfloat16()
        x = torch.randn(rows, k).bfloat16()
        bias = (torch.randn(n) * 0.1).bfloat16() if with_bias else None
        packed = kernels.cpu.small_gemm_pack(weight)
        rounded = kernels.cpu.small_gemm(x, packed, bias)
        sums = kernels.cpu.small_gemm(x, packed, bias, out_dtype=torch.float32)
        assert sums.dtype == torch.float32 and rounded.dtype == torch.bfloat16
        assert torch.equal(sums.bfloat16(), rounded)
        want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        torch.testing.assert_close(sums.double(), want, rtol=1e-5, atol=1e-5)  # fp32 sums in another order
        assert (sums.double() - want).abs().mean() < (rounded.double() - want).abs().mean() / 10


def test_an_fp32_out_linear_takes_every_row_count_through_small_gemm_unrounded():
    """``fp32_out`` (the LM head): no oneDNN copy; rows past the kernel's limit go in slices, each row the fp32 sums
    that round to the bf16 result."""
    from backend.models.layers import Linear

    if not kernels.cpu.small_gemm_available(torch.bfloat16):
        pytest.skip("no bf16 small_gemm on this CPU")
    torch.manual_seed(12)
    weight, bias = (torch.randn(96, 64) * 0.1).bfloat16(), (torch.randn(96) * 0.1).bfloat16()
    head = Linear(weight, bias, small_batch=True, fp32_out=True)
    plain = Linear(weight, bias, small_batch=True)
    assert head.weight is None and head.out_dtype == torch.float32 and plain.out_dtype is None
    limit = min(kernels.cpu.small_gemm_max_rows(torch.bfloat16), 256)  # AVX2: every GEMM, any number of rows
    for rows in (0, 1, limit, limit + 1, 2 * limit + 3):
        x = torch.randn(rows, 64).bfloat16()
        logits = head(x)
        assert logits.dtype == torch.float32 and logits.shape == (rows, 96)
        want = torch.cat([kernels.cpu.small_gemm(x[i:i + 1], head.small_batch, bias, out_dtype=torch.float32)
                          for i in range(rows)]) if rows else logits
        assert torch.equal(logits, want)  # each row's sums do not depend on its batch
        if rows <= kernels.cpu.small_gemm_max_rows(torch.bfloat16):  # plain: small_gemm too (else oneDNN)
            assert torch.equal(logits.bfloat16(), plain(x))
    assert Linear(weight.float(), small_batch=True, fp32_out=True).out_dtype is None  # fp32 already


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_avx2_keeps_one_copy_and_takes_every_gemm(monkeypatch, dtype):
    from backend import cpu_ops
    from backend.models.layers import Linear

    if not kernels.cpu.small_gemm_available(dtype) or kernels.cpu.small_gemm_max_rows(dtype) != kernels.cpu.EVERY_GEMM:
        pytest.skip(f"small_gemm takes every {dtype} GEMM only on AVX2 without AVX-512")

    torch.manual_seed(11)
    weight, bias = (torch.randn(96, 64) * 0.1).to(dtype), (torch.randn(96) * 0.1).to(dtype)
    linear = Linear(weight, bias, small_batch=True)
    packed_shape = (6, 64, 16) if dtype == torch.float32 else (6, 32, 16, 2)
    assert linear.weight is None and linear.small_batch.shape == packed_shape  # the tile layout only
    calls = []
    original = kernels.cpu.small_gemm
    monkeypatch.setattr(cpu_ops, "small_gemm",
                        lambda *args, **kw: calls.append(args[0].shape[0]) or original(*args, **kw),
                        raising=False)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    for rows in (0, 1, 5, 300, 2100):
        x = torch.randn(rows, 64).to(dtype)
        got = linear(x)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got.double(), F.linear(x.double(), weight.double(), bias.double()), **tolerance)
    assert calls == [1, 5, 300, 2100]  # no rows: an empty result without a call
    assert Linear(weight, bias).weight is not None  # without small_batch, oneDNN's copy


@pytest.mark.skipif(not kernels.cpu.small_gemm_available()
                    or kernels.cpu.small_gemm_max_rows(torch.bfloat16) == kernels.cpu.EVERY_GEMM,
                    reason="no AMX or AVX512-BF16 on this CPU (on AVX2, small_gemm takes every GEMM)")
def test_linear_takes_the_small_gemm_up_to_its_row_limit_and_onednn_above(monkeypatch):
    from backend import cpu_ops
    from backend.models.layers import Linear

    torch.manual_seed(9)
    weight, bias = (torch.randn(96, 64) * 0.1).bfloat16(), (torch.randn(96) * 0.1).bfloat16()
    linear = Linear(weight, bias, small_batch=True)
    assert linear.small_batch is not None and Linear(weight, bias).small_batch is None
    assert Linear(weight[:, :48], bias, small_batch=True).small_batch is None  # bf16 needs K % 32 == 0
    calls = []
    original = kernels.cpu.small_gemm
    limit = kernels.cpu.small_gemm_max_rows(torch.bfloat16)
    assert limit in (64, 256) and kernels.cpu.small_gemm_max_rows(torch.float32) == 256  # 64 on AMX tiles
    # The layers reach the kernel through cpu_ops, which binds it on first use: patch that binding.
    monkeypatch.setattr(cpu_ops, "small_gemm",
                        lambda *args, **kw: calls.append(args[0].shape[0]) or original(*args, **kw),
                        raising=False)
    for rows in (0, 1, limit, limit + 1, 300):  # no rows (a step that samples nothing) goes to oneDNN
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(linear(x).float(), F.linear(x.float(), weight.float(), bias.float()),
                                   rtol=2 ** -7, atol=1e-3)
    assert calls == [1, limit]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_with_the_tile_layout_only_runs_prompts_through_it_in_slices(monkeypatch, dtype):
    """A model too large for two copies keeps only small_gemm's layout (``small_batch_only``): GEMMs of more rows
    than one call takes go through it slice by slice, and equal ``F.linear``'s up to summation order."""
    from backend import cpu_ops
    from backend.models.layers import Linear

    limit = kernels.cpu.small_gemm_max_rows(dtype) if kernels.cpu.small_gemm_available(dtype) else 0
    if not 0 < limit < kernels.cpu.EVERY_GEMM:
        pytest.skip(f"small_gemm has no row limit for {dtype} here (AVX2: it takes every GEMM) or does not run")
    torch.manual_seed(12)
    weight, bias = (torch.randn(96, 64) * 0.1).to(dtype), (torch.randn(96) * 0.1).to(dtype)
    linear = Linear(weight, bias, small_batch=True, small_batch_only=True)
    assert linear.weight is None and not linear.packed and linear.small_batch is not None
    assert Linear(weight, bias, small_batch=True).weight is not None  # without it: oneDNN's copy beside
    calls = []
    original = kernels.cpu.small_gemm
    monkeypatch.setattr(cpu_ops, "small_gemm", lambda *args, **kw: calls.append(args[0].shape[0])
                        or original(*args, **kw), raising=False)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    for rows in (0, 1, limit, limit + 1, 2 * limit + 5):
        x = torch.randn(rows, 64).to(dtype)
        got = linear(x)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got.double(), F.linear(x.double(), weight.double(), bias.double()), **tolerance)
    assert calls == [1, limit, limit, 1, limit, limit, 5]  # no rows: an empty result without a call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_of_2_mib_or_more_start_on_a_2_mib_boundary_in_the_tile_layout(dtype):
    """``small_gemm_pack`` and ``int8_gemm_pack`` put weights of at least 2 MiB on a mapping of their own, aligned
    for 2 MiB pages; the values are the tile layout's (a permuted copy) and survive a clone."""
    if not kernels.cpu.small_gemm_available(dtype):
        pytest.skip(f"small_gemm does not run {dtype} here")
    torch.manual_seed(13)
    for n, k, big in ((2048, 1024, True), (64, 64, False)):
        weight = torch.randn(n, k).to(dtype)
        packed = kernels.cpu.small_gemm_pack(weight)
        tiles = (weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3) if dtype == torch.bfloat16
                 else weight.reshape(n // 16, 16, k).permute(0, 2, 1))
        assert torch.equal(packed, tiles) and packed.is_contiguous() and torch.equal(packed.clone(), tiles)
        if big:  # small ones come from torch's allocator, wherever it puts them
            assert packed.data_ptr() % (2 << 20) == 0
        if kernels.cpu.int8_gemm_available(dtype):
            q = kernels.cpu.int8_gemm_pack(weight)
            assert q.data_ptr() % (2 << 20) == 0 or q.numel() * q.element_size() < (2 << 20)
            scale = weight.float().abs().amax(1, keepdim=True) / 127
            torch.testing.assert_close(kernels.cpu.int8_gemm_unpack(q, k), weight.float(), rtol=0,
                                       atol=float(scale.max()) / 2 + 1e-6)


def test_auto_dtype_is_bf16_only_where_it_runs_at_least_as_fast_as_fp32():
    """``dtype: auto`` on a CPU: bf16 with hardware bf16 (AVX512-BF16, AMX); on AVX2 without AVX-512, bf16 only when
    ``small_gemm`` runs it and the model's GEMMs go through the C++ kernels (else ``F.linear`` would run bf16 at
    several times fp32's time); fp32 otherwise. An explicit dtype is kept as given."""
    from backend.config import cpu_has_native_bf16, resolve_dtype

    native = cpu_has_native_bf16()
    kernels_bf16 = kernels.cpu.small_gemm_available(torch.bfloat16)
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native or kernels_bf16 else "float32")
    assert resolve_dtype("auto", "cpu", cpu_kernels=False) == ("bfloat16" if native else "float32")
    assert resolve_dtype("float32", "cpu") == "float32" and resolve_dtype("bfloat16", "cpu", False) == "bfloat16"
