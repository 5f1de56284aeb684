"""int8 weights and activations (``quantization w8a8``): the kernel equals a matmul of the group-rounded activations
with the dequantized weights, each row's result does not depend on its batch, and it is refused with the reason
where it cannot run (decoding in one C++ call equals the Python loop, and the real model stays within 1% of bf16's
perplexity: tests/test_int8.py)."""

from __future__ import annotations

import pytest
import torch

import kernels.cpu
from backend import EngineConfig
from backend.models.layers import Linear

pytestmark = pytest.mark.skipif(not kernels.cpu.w8a8_gemm_available(), reason="kernels/cpu without AVX512-VNNI")
_NO_BF16 = pytest.mark.skipif(not kernels.cpu.int8_gemm_available(torch.bfloat16), reason="no AVX512-BF16")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=_NO_BF16)]


def group_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` as the kernel rounds it, in fp64: per row and group of 64 k, ``round(x * (127 / amax))``
    (fp32 arithmetic, ties to even) times ``amax / 127``; an all-zero group stays zero."""
    m, k = x.shape
    groups = x.float().view(m, k // 64, 64)
    amax = groups.abs().amax(-1, keepdim=True)
    # 127 / amax as one fp32 division, as the kernel divides (torch's ``127 / tensor`` is 127 * (1 / tensor),
    # which rounds differently and moves products such as 63.500004 to 63.499996).
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    q = torch.round(groups * inv).clamp(-127, 127)
    return (q.double() * (amax.double() / 127)).view(m, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(16, 64), (48, 576), (80, 1536)])
def test_w8a8_gemm_equals_the_rounded_activations_times_the_dequantized_weights(dtype, n, k):
    torch.manual_seed(n + k)
    packed = kernels.cpu.int8_gemm_pack(torch.randn(n, k) * 0.05)
    dequantized = kernels.cpu.int8_gemm_unpack(packed, k).double()
    for m in (1, 2, 7, 8, 9, 17, 64, 300):
        x = torch.randn(m, k)
        x[0, :64] = 0  # an all-zero group
        x[-1, 5] = 40.0  # an outlier: its group's other activations round coarsely, the other groups do not
        if m > 2:
            x[1] = x[1].abs()  # one sign throughout (after a ReLU): the largest offsets the weights' 128 adds
        x = x.to(dtype)
        for bias in (None, torch.randn(n).to(dtype)):
            rounded = group_rounded(x)
            want = rounded @ dequantized.T + (0 if bias is None else bias.double())
            got = kernels.cpu.int8_gemm(x, packed, bias, int8_activations=True)
            assert got.dtype == dtype and got.shape == (m, n)
            # Exact integer sums per group; fp32 rounding of the groups' scaled sums, and bf16's of the result.
            rtol = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
            bound = rtol * want.abs() + 1e-6 * (rounded.abs() @ dequantized.abs().T)
            excess = (got.double() - want).abs() - bound
            assert excess.max() <= 0, f"m={m}: off by {excess.max():.3g} more than the bound"


def test_w8a8_gemm_is_within_half_a_step_per_activation_of_the_exact_product():
    torch.manual_seed(3)
    k = 256
    packed = kernels.cpu.int8_gemm_pack(torch.randn(32, k) * 0.05)
    dequantized = kernels.cpu.int8_gemm_unpack(packed, k).double()
    x = torch.randn(20, k)
    exact = x.double() @ dequantized.T
    step = x.double().view(20, k // 64, 64).abs().amax(-1, keepdim=True).expand(20, k // 64, 64).reshape(20, k) / 127
    bound = (step / 2) @ dequantized.abs().T + 1e-5
    got = kernels.cpu.int8_gemm(x, packed, int8_activations=True).double()
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).abs().max() > 1e-4  # the activations were rounded: not the weight-only result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, m", [(80, 140), (48, 17), (32, 33)])
def test_w8a8_gemm_rows_do_not_depend_on_the_batch(dtype, n, m):
    # Each row is rounded with its own group scales and each output's groups are added in one order whatever the
    # rows per pass: a request's greedy tokens do not depend on what it is batched with. Where the CPU has AMX-INT8
    # a call of 12 rows or more runs on tiles and a single row on vectors: the same bits.
    torch.manual_seed(n + m)
    packed = kernels.cpu.int8_gemm_pack(torch.randn(n, 1088) * 0.05)
    bias = torch.randn(n).to(dtype)
    x = torch.randn(m, 1088).to(dtype)
    batched = kernels.cpu.int8_gemm(x, packed, bias, int8_activations=True)
    for i in sorted({*range(10), 15, 16, m // 2, m - 1}):
        alone = kernels.cpu.int8_gemm(x[i:i + 1], packed, bias, int8_activations=True)
        assert torch.equal(batched[i:i + 1], alone), f"row {i}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [3, 40])
def test_w8a8_gemm_of_a_row_with_nan_is_nan(dtype, m):
    packed = kernels.cpu.int8_gemm_pack(torch.randn(32, 128))
    x = torch.randn(m, 128).to(dtype)
    x[1, 70] = float("nan")
    got = kernels.cpu.int8_gemm(x, packed, int8_activations=True)
    assert got[1].isnan().all() and not got[0].isnan().any() and not got[2:].isnan().any()


@pytest.mark.parametrize("m", [1, 40])  # the vector kernel; AMX tiles where the CPU has them
def test_w8a8_gemm_of_infinite_and_tiny_activations_is_the_float_products(m):
    # -inf times 127 / inf was NaN, clamped to +127: the sign flipped; a group under ~3.7e-37 made 127 / amax
    # infinite and rounded its zeros to 127.
    torch.manual_seed(4)
    packed = kernels.cpu.int8_gemm_pack(torch.randn(32, 128) * 0.05)
    dequantized = kernels.cpu.int8_gemm_unpack(packed, 128).double()
    x = torch.randn(m, 128)
    x[0, 5] = float("-inf")
    want = x.double() @ dequantized.T
    got = kernels.cpu.int8_gemm(x, packed, int8_activations=True)
    # +-inf by each weight's sign; NaN for a weight rounded to 0, as inf * 0
    torch.testing.assert_close(got[0], want[0].float(), rtol=0, atol=0, equal_nan=True)
    x[0, 6] = float("inf")  # inf - inf in one group: NaN (the group's integer sum cannot say which sign met which)
    assert kernels.cpu.int8_gemm(x, packed, int8_activations=True)[0].isnan().all()
    tiny = torch.zeros(m, 128)
    tiny[:, 0], tiny[:, 3], tiny[:, 70] = 1e-37, -3e-38, 2e-39
    want = tiny.double() @ dequantized.T
    got = kernels.cpu.int8_gemm(tiny, packed, int8_activations=True).double()
    assert ((got - want).abs() <= 0.02 * want.abs().max()).all()


def test_w8a8_linear_runs_int8_activations():
    torch.manual_seed(2)
    weight, bias, x = torch.randn(48, 128), torch.randn(48), torch.randn(5, 128)
    w8a8 = Linear(weight, bias, quantization="w8a8")
    int8 = Linear(weight, bias, quantization="int8")
    assert torch.equal(w8a8.small_batch, int8.small_batch)  # the same int8 weights
    assert torch.equal(w8a8(x), kernels.cpu.int8_gemm(x, w8a8.small_batch, bias, int8_activations=True))
    assert not torch.equal(w8a8(x), int8(x))


def test_w8a8_without_avx512_vnni_is_refused_with_the_reason(monkeypatch):
    from backend import cpu_ops

    monkeypatch.setattr(cpu_ops, "w8a8_gemm_available", lambda: False)
    with pytest.raises(ValueError, match="w8a8 cannot run here.*AVX512-VNNI"):
        Linear(torch.randn(32, 128), quantization="w8a8")


def test_w8a8_refuses_what_the_kernel_cannot_run():
    with pytest.raises(ValueError, match="w8a8 cannot run here.*multiple of 64"):
        Linear(torch.randn(32, 96), quantization="w8a8")
    Linear(torch.randn(32, 96), quantization="int8")  # weight-only int8 takes it
    packed = kernels.cpu.int8_gemm_pack(torch.randn(32, 96))
    with pytest.raises(RuntimeError, match="K % 64 == 0"):
        kernels.cpu.int8_gemm(torch.randn(2, 96), packed, int8_activations=True)
    with pytest.raises(ValueError, match="one of none, int8, w8a8"):
        EngineConfig(quantization="w4a8")
    with pytest.raises(ValueError, match="CPU kernel"):
        EngineConfig(quantization="w8a8", device="cuda")


def test_benchmark_limits_do_not_bound_w8a8_by_the_float_gemm_peak():
    from benchmarks.limits import markdown

    limits = {"bandwidth_gbps": 30.0, "weight_bytes_per_step": 1.71e9, "weight_format": "int8", "itl_floor_ms": 57.0,
              "decode_tokens_per_s_per_stream_bound": 17.5, "gemm_dtype": "bfloat16", "gemm_gflops": 420.0,
              "compute_bound_tokens_per_s": 123.0}
    assert "gives at most 123 tokens/s at any batch" in markdown(limits, "int8")
    text = markdown(limits, "w8a8")
    assert "123 tokens/s" not in text and "not bound by the bfloat16 GEMM peak of 420 GFLOP/s" in text
