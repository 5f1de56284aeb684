"""Weight-only int8 (``quantization int8``): the kernel equals a matmul with the dequantized weights, the engine
equals transformers running those same dequantized weights, decodes identically in one C++ call and in the Python
loop (``w8a8`` too), costs the real model under 1% of bf16's perplexity (``w8a8`` too), and is refused with the
reason where it cannot run."""

from __future__ import annotations

import pytest
import torch

import kernels.cpu
from backend import EngineConfig, SamplingParams
from backend.models.layers import Linear
from conftest import ReferenceModel, assert_matches_reference, run_to_completion

pytestmark = pytest.mark.skipif(not kernels.cpu.int8_gemm_available(torch.float32),
                                reason="kernels/cpu without AVX-512 or AVX2 with FMA")
_NO_BF16 = pytest.mark.skipif(not kernels.cpu.int8_gemm_available(torch.bfloat16),
                              reason="no AVX512-BF16 or AVX2 with FMA")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=_NO_BF16)]
DTYPE_NAMES = ["float32", pytest.param("bfloat16", marks=_NO_BF16)]


def assert_within_activation_rounding(got, want, x, dequantized, atol, rtol=1e-5):
    """``got`` equals the exact ``want`` but for the result's rounding (relative ``rtol``: 1e-5 for fp32, 2^-8 for a
    bf16 result, plus ``atol``) and, where the kernel rounds each row of ``x`` to int16 (AVX2's vpmaddwd path, bf16
    rows widened first), at most half a step (``max|x[m]| / 32767 / 2``) per activation times the weights'
    magnitudes: sum_k |w[n][k]| * step[m] / 2."""
    step = x.double().abs().amax(1, keepdim=True) / 32767
    bound = step / 2 * dequantized.double().abs().sum(1)[None, :] + rtol * want.abs() + atol
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"off by {excess.max():.3g} more than the bound at {divmod(int(excess.argmax()), want.shape[1])}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(16, 2), (48, 130), (80, 1000)])
def test_int8_gemm_equals_dequantized_matmul(dtype, n, k):
    torch.manual_seed(n + k)
    weight = torch.randn(n, k) * 0.05
    packed = kernels.cpu.int8_gemm_pack(weight)
    dequantized = kernels.cpu.int8_gemm_unpack(packed, k)
    # Per-channel symmetric quantization: each weight within half a step (scale / 2) of the original.
    step = weight.abs().amax(1, keepdim=True) / 127
    assert ((dequantized - weight).abs() <= step / 2 + 1e-7).all()
    for m in (1, 2, 3, 5, 6, 7, 13, 64):
        x = torch.randn(m, k).to(dtype)
        for bias in (None, torch.randn(n).to(dtype)):
            want = x.double() @ dequantized.double().T + (0 if bias is None else bias.double())
            got = kernels.cpu.int8_gemm(x, packed, bias)
            assert got.dtype == dtype and got.shape == (m, n)
            if dtype == torch.float32:  # fp32 sums in another order, activations rounded to int16 on AVX2
                assert_within_activation_rounding(got, want, x, dequantized, atol=1e-5 * k ** 0.5)
            else:  # the fp32 result rounded once to bf16
                assert_within_activation_rounding(got, want, x, dequantized, atol=1e-5 * k ** 0.5, rtol=2 ** -8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_gemm_rows_do_not_depend_on_the_batch(dtype):
    # Each output's sum runs in one order whatever the row count (bf16 from 128 rows widens the weights once per
    # group instead of per pass; fp32 on AVX2 rounds each row to int16 on its own and sums runs of 256 k pairs in
    # int32, one row or two at a time): a request's greedy tokens do not depend on what it is batched with.
    torch.manual_seed(1)
    weight = torch.randn(80, 1100) * 0.05  # K over one staged run of 512 pairs
    packed = kernels.cpu.int8_gemm_pack(weight)
    bias = torch.randn(80).to(dtype)
    x = torch.randn(140, 1100).to(dtype)
    batched = kernels.cpu.int8_gemm(x, packed, bias)
    for i in (*range(13), 77, 139):
        assert torch.equal(batched[i:i + 1], kernels.cpu.int8_gemm(x[i:i + 1], packed, bias)), f"row {i}"


@_NO_BF16
def test_int8_gemm_fp32_out_is_the_bf16_sums_before_their_rounding():
    """bf16 rows with ``out_dtype`` fp32 (an int8 LM head's logits): the sums the bf16 result rounds, bit for bit,
    in one pass, several, and from the staged path's row count on (STAGED_MIN_ROWS)."""
    torch.manual_seed(3)
    weight = torch.randn(80, 1100) * 0.05
    packed = kernels.cpu.int8_gemm_pack(weight)
    bias = torch.randn(80).bfloat16()
    for m in (1, 12, 13, 140, 300):
        x = torch.randn(m, 1100).bfloat16()
        sums = kernels.cpu.int8_gemm(x, packed, bias, out_dtype=torch.float32)
        assert sums.dtype == torch.float32
        assert torch.equal(sums.bfloat16(), kernels.cpu.int8_gemm(x, packed, bias)), f"{m} rows"
        assert not torch.equal(sums, sums.bfloat16().float())


def test_int8_gemm_takes_prompt_rows_in_chunks():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    packed = kernels.cpu.int8_gemm_pack(weight)
    x = torch.randn(600, 64)  # more than int8_gemm_max_rows: three calls
    dequantized = kernels.cpu.int8_gemm_unpack(packed, 64)
    want = x.double() @ dequantized.double().T
    assert_within_activation_rounding(kernels.cpu.int8_gemm(x, packed), want, x, dequantized, atol=1e-4)


def test_int8_gemm_unpack_bf16_rounds_the_fp32_values():
    weight = torch.randn(32, 40)
    packed = kernels.cpu.int8_gemm_pack(weight)
    assert torch.equal(kernels.cpu.int8_gemm_unpack(packed, 40, torch.bfloat16),
                       kernels.cpu.int8_gemm_unpack(packed, 40).bfloat16())


def test_int8_linear_refuses_what_the_kernel_cannot_run():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        Linear(torch.randn(32, 16, dtype=torch.float16), quantization="int8")
    with pytest.raises(ValueError, match="multiple of 16"):
        Linear(torch.randn(40, 16), quantization="int8")
    with pytest.raises(ValueError, match="in_features even"):
        Linear(torch.randn(32, 15), quantization="int8")
    with pytest.raises(ValueError, match="none, int8 or w8a8"):
        Linear(torch.randn(32, 16), quantization="int4")


@pytest.mark.parametrize("settings, message", [
    (dict(quantization="int4"), "one of none, int8, w8a8"),
    (dict(quantization="int8", device="cuda"), "CPU kernel"),
    (dict(quantization="int8", dtype="float16"), "float32 or bfloat16"),
    (dict(quantization="int8", model_impl="transformers"), "compact decoder"),
    (dict(quantization="int8", model_runner="zero_cost"), "default model runner"),
])
def test_engine_config_refuses_int8_where_it_cannot_run(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_int8_for_a_model_the_compact_decoder_cannot_run_is_refused(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from backend.models import build_decoder
    from conftest import build_tiny_model

    directory = build_tiny_model(tmp_path / "mistral", "mistral", tokenizer, sliding_window=16)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    assert build_decoder(hf_model, 1024) is None  # unquantized: transformers' modules run it
    with pytest.raises(ValueError, match="needs the compact decoder.*sliding window"):
        build_decoder(hf_model, 1024, quantization="int8")


def _dequantized_reference(model_dir: str) -> ReferenceModel:
    """transformers' model with every linear weight the engine quantizes replaced by its dequantized int8 value
    (QKV and gate-up quantized row by row, as the fused weights are: per output channel, the same scales)."""
    reference = ReferenceModel(model_dir)
    with torch.no_grad():
        for module in reference.model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.shape[0] % 16 == 0:
                w = module.weight
                module.weight.copy_(kernels.cpu.int8_gemm_unpack(kernels.cpu.int8_gemm_pack(w), w.shape[1]))
    return reference


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])  # Qwen2: QKV bias; Qwen3: q/k norms, the layer loop
def test_int8_engine_equals_transformers_on_the_dequantized_weights(family, make_engine, tiny_model_dir, tmp_path,
                                                                    tokenizer):
    from conftest import build_tiny_model

    model_dir = tiny_model_dir if family == "llama" else build_tiny_model(tmp_path / family, family, tokenizer)
    reference = _dequantized_reference(model_dir)
    engine = make_engine(model_dir, quantization="int8")
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140)), [7] * 3]
    sinks = {str(i): engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                        request_id=str(i)) for i, p in enumerate(prompts)}
    outs = run_to_completion(engine, sinks)
    for i, prompt in enumerate(prompts):
        got = [t for o in outs[str(i)] for t in o.token_ids]
        want, logits = reference.greedy(prompt, 12)
        assert_matches_reference(got, want, logits, f"prompt {i}")


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("quantization", ["int8", pytest.param("w8a8", marks=pytest.mark.skipif(
    not kernels.cpu.w8a8_gemm_available(), reason="kernels/cpu without AVX512-VNNI"))])
def test_int8_decode_in_one_call_equals_the_layer_loop(make_engine, tiny_model_dir, dtype, quantization):
    prompts = [[1, 2, 3, 4, 5], list(range(100, 140)), [7] * 3, list(range(300, 317))]
    results = []
    for in_one_call in (True, False):
        engine = make_engine(tiny_model_dir, quantization=quantization, dtype=dtype)
        decoder = engine.engine_core.model_runner.decoder
        assert decoder.decode_in_one_call and decoder.lm_head.quantization == quantization
        decoder.decode_in_one_call = in_one_call
        sinks = {str(i): engine.add_request(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                                            request_id=str(i)) for i, p in enumerate(prompts)}
        outs = run_to_completion(engine, sinks)
        results.append([[t for o in outs[str(i)] for t in o.token_ids] for i in range(len(prompts))])
    assert results[0] == results[1]
    assert all(len(tokens) == 10 for tokens in results[0])


@pytest.mark.real_model
@pytest.mark.parametrize("quantization, windows, window_tokens", [
    ("int8", 2, 256),
    # Rounding the activations moves a token's logprob more than rounding the weights does: a few hundred tokens
    # measure w8a8 within about 1% only (2 windows of 256: +1.6%; 32 of 512, 16k tokens: +0.5%).
    pytest.param("w8a8", 32, 512, marks=[pytest.mark.slow, pytest.mark.skipif(
        not kernels.cpu.w8a8_gemm_available(), reason="kernels/cpu without AVX512-VNNI")]),
])
def test_int8_perplexity_of_the_real_model_within_one_percent_of_bf16(quantization, windows, window_tokens):
    """bf16 activations where the kernels take them (AVX512-BF16, AVX2); fp32 elsewhere (the same int8 weights)."""
    from benchmarks.int8 import corpus_windows, perplexity

    dtype = "bfloat16" if kernels.cpu.int8_gemm_available(torch.bfloat16) else "float32"
    scored = corpus_windows(windows, window_tokens)
    base = perplexity("none", dtype, scored)
    quantized = perplexity(quantization, dtype, scored)
    assert 1 < base < 100
    assert abs(quantized - base) / base < 0.01, f"{quantization} perplexity {quantized:.4f}, {dtype} {base:.4f}"


def test_benchmark_passes_quantization_to_our_engine():
    from benchmarks.__main__ import parse_args
    from benchmarks.config import BenchConfig
    from benchmarks.engine_system import engine_config

    assert parse_args([]).quantization == "none"
    config = parse_args(["--quantization", "int8", "--systems", "engine"])
    assert engine_config(config).quantization == "int8"
    with pytest.raises(SystemExit):
        parse_args(["--quantization", "int4"])
    with pytest.raises(ValueError, match="one of none, int8, w8a8"):
        BenchConfig(quantization="int4")


def test_benchmark_int8_weight_bytes_are_what_a_decode_step_reads(make_engine, tiny_model_dir):
    """The benchmark's physical limit for ``--quantization int8`` counts the packed int8 weights and their scales."""
    from transformers import AutoConfig

    from backend.models.layers import Linear
    from benchmarks.memory_floor import int8_weight_bytes

    decoder = make_engine(tiny_model_dir, quantization="int8").engine_core.model_runner.decoder
    packed = [m.small_batch for m in decoder.modules() if isinstance(m, Linear)]
    assert packed and all(p.dtype == torch.int8 for p in packed)
    assert int8_weight_bytes(AutoConfig.from_pretrained(tiny_model_dir)) == sum(p.numel() for p in packed)
