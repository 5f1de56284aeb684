"""int8 weights (``quantization int8``, and ``w8a8`` with int8 activations too): what they cost in quality and what
they save in time.

``python -m benchmarks.int8 quality [--windows N] [--window-tokens T] [--max-tokens N] [--llamacpp]``: the perplexity of the
default model (SmolLM2-135M-Instruct) on the benchmark's English corpus (``benchmarks.workload.corpus_text``) with
the engine in fp32, bf16 and with int8 weights (bf16 activations where the kernels take them: AVX512-BF16, or AVX2 through the fp32 path),
each window's tokens scored by its own prefill (prompt logprobs), and how many of
:data:`benchmarks.dtype_agreement.PROMPTS`' greedy outputs int8 leaves identical to the same activations' float
weights; where the kernels take int8 activations (AVX512-VNNI) the same for ``w8a8``. With ``--llamacpp``, also
llama.cpp's own perplexity (``llama-perplexity``, built by ``make llamacpp``) of the same model converted to a
GGUF in bf16 and quantized to Q8_0 and Q4_0, on the same corpus in windows of the same length: each tool's
quantized weights are compared with its own bf16 (the two tools score windows differently).

``python -m benchmarks.int8 gemm [--shape NAME] [--rows 1,4,16,64] [--repeats N]``: one decoder layer's GEMMs
(QKV, O, gate-up, down) of a shape of ``benchmarks.shapes`` with random weights, in ms per layer (best of
``repeats``): ``int8_gemm`` (bf16 activations where it takes them, else fp32; and with int8 activations, W8A8, where
it takes them) against ``small_gemm`` with bf16 and fp32 weights
(past the rows ``small_gemm`` takes, and for bf16 where it has no bf16 path: ``F.linear``), and oneDNN's fp32 GEMM on
prepacked weights with the ratio of its time to the fp32 column's (1.00x where both are oneDNN). A decode step of
the model runs this once per layer. Each timing runs through as many copies of the layer as make its int8 weights
at least :data:`STREAMED_BYTES`, so that the weights stream from memory as in a whole step, not from the L3 cache.
"""

from __future__ import annotations

import argparse
import functools
import math
import time

import torch

from backend import EngineConfig, LLMEngine, SamplingParams


def perplexity(quantization: str, dtype: str, windows: list[list[int]], score_from: int = 1) -> float:
    """exp of the mean negative log-likelihood of every window's tokens from index ``score_from`` on (1: all
    after the first), scored by the engine (``dtype``, ``quantization``) as prompt logprobs; each window is its own
    request (no shared cache). ``score_from`` = half the window + 1 scores the tokens ``llama-perplexity`` does."""
    engine = LLMEngine(EngineConfig(dtype=dtype, quantization=quantization, num_blocks=1024,
                                    enable_prefix_caching=False))
    try:
        total, count = 0.0, 0
        for i, window in enumerate(windows):
            sink = engine.add_request(window, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                                      request_id=f"w{i}")
            while engine.has_unfinished_requests():
                engine.step()
            entries = None
            while not sink.empty():
                out = sink.get_nowait()
                if out.prompt_logprobs is not None:
                    entries = out.prompt_logprobs
            for entry in entries[score_from:]:
                total -= entry.logprob
                count += 1
        return math.exp(total / count)
    finally:
        engine.shutdown()


def corpus_windows(num_windows: int, window_tokens: int) -> list[list[int]]:
    """The first ``num_windows`` windows of ``window_tokens`` tokens of the benchmark corpus (default tokenizer)."""
    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir
    from benchmarks.workload import corpus_text

    ids = AutoTokenizer.from_pretrained(resolve_model_dir(None))(corpus_text())["input_ids"]
    if len(ids) < num_windows * window_tokens:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than {num_windows} x {window_tokens}")
    return [ids[i * window_tokens:(i + 1) * window_tokens] for i in range(num_windows)]


def int8_activations() -> str:
    """The activations' dtype int8 weights run with here: bfloat16 where ``int8_gemm`` takes it (AVX512-BF16, or
    AVX2 through its fp32 path), else float32."""
    from kernels import cpu

    return "bfloat16" if cpu.int8_gemm_available(torch.bfloat16) else "float32"


def greedy_agreement(max_tokens: int, dtype: str, quantization: str = "int8") -> tuple[int, int, list[int]]:
    """(identical outputs, prompts, first divergent output index of each other one): ``quantization`` (int8 or w8a8)
    against float weights, both with ``dtype`` activations."""
    from benchmarks.dtype_agreement import PROMPTS, greedy_outputs

    outputs = [greedy_outputs(dtype, max_tokens, q) for q in ("none", quantization)]
    diverged = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(*outputs) if a != b]
    return len(PROMPTS) - len(diverged), len(PROMPTS), sorted(diverged)


def llamacpp_quality(windows: int, window_tokens: int) -> None:
    """Prints llama.cpp's perplexity of the default model with bf16, Q8_0 and Q4_0 weights on the benchmark
    corpus, and each quantized one's change against bf16; first ours (bf16 activations) scoring the same tokens
    (each window's second half)."""
    from backend.model_loader import resolve_model_dir
    from benchmarks.llamacpp_system import ensure_gguf, ensure_llamacpp, llamacpp_perplexity
    from benchmarks.workload import corpus_text

    from kernels import cpu

    bin_dir, model_dir, text = ensure_llamacpp(), resolve_model_dir(None), corpus_text()
    scored = corpus_windows(windows, window_tokens)
    base = None
    for quantization in ("none", "int8", "w8a8") if cpu.w8a8_gemm_available() else ("none", "int8"):
        value = perplexity(quantization, "bfloat16", scored, score_from=window_tokens // 2 + 1)
        base = value if base is None else base
        change = "" if quantization == "none" else f" ({(value / base - 1) * 100:+.2f}% against its bf16)"
        print(f"perplexity ours {quantization}, bf16, second halves scored (as llama.cpp): {value:.4f}{change}")
    base = None
    for quant in (None, "q8_0", "q4_0"):
        gguf = ensure_gguf(model_dir, "bfloat16", quant, bin_dir=bin_dir)
        value = llamacpp_perplexity(gguf, text, window_tokens, windows, torch.get_num_threads(), bin_dir)
        base = value if base is None else base
        change = "" if quant is None else f" ({(value / base - 1) * 100:+.2f}% against its bf16)"
        print(f"llama.cpp perplexity {quant or 'bf16'}: {value:.4f}{change}")


STREAMED_BYTES = 128 << 20  # more than the L3 caches of the CPUs this runs on (32 MiB on the reference machine)


def layer_gemm_ms(shape: str, rows: list[int],
                  repeats: int) -> list[tuple[int, float | None, float, float, float, float]]:
    """Per row count: (rows, W8A8 ms or None where the kernels have no int8 activations, int8 ms, bf16 ms, fp32 ms,
    fp32 oneDNN ms) for one decoder layer's four GEMMs, best of
    ``repeats`` runs over enough copies of the layer to stream :data:`STREAMED_BYTES` of int8 weights, divided by
    the copies. The last is oneDNN's fp32 GEMM on prepacked weights (what the engine runs where ``small_gemm``
    does not), beside what the engine runs for fp32 weights."""
    from benchmarks.shapes import COMMON, SHAPES
    from kernels import cpu

    s = {**COMMON, **SHAPES[shape]}
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    heads, kv_heads = s["num_attention_heads"], s["num_key_value_heads"]
    head_dim = s.get("head_dim", hidden // heads)
    shapes = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
              (hidden, inter)]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) * 0.02 for n, k in shapes]
    copies = -(-STREAMED_BYTES // sum(n * k for n, k in shapes))
    int8_dtype = getattr(torch, int8_activations())
    packs = {"int8": [cpu.int8_gemm_pack(w) for _ in range(copies) for w in weights]}
    for kind, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        plain = [w.to(dtype) for _ in range(copies) for w in weights]
        packs[kind] = ([cpu.small_gemm_pack(w) for w in plain] if cpu.small_gemm_available(dtype) else [], plain)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in packs["fp32"][1]]

    def onednn_gemm(x, packed):
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def float_gemm(kind: str, dtype: torch.dtype, m: int):
        small = bool(packs[kind][0]) and m <= cpu.small_gemm_max_rows(dtype)
        return (cpu.small_gemm, packs[kind][0]) if small else (torch.nn.functional.linear, packs[kind][1])

    results = []
    for m in rows:
        xs = [torch.randn(m, k, generator=generator) for _, k in shapes] * copies
        times: list[float | None] = []
        kinds = [("int8", int8_dtype), ("bf16", torch.bfloat16), ("fp32", torch.float32), ("onednn", torch.float32)]
        if cpu.w8a8_gemm_available():
            kinds.insert(0, ("w8a8", int8_dtype))
        else:
            times.append(None)
        for kind, dtype in kinds:
            if kind == "w8a8":
                gemm, weights_of_kind = functools.partial(cpu.int8_gemm, int8_activations=True), packs["int8"]
            elif kind == "int8":
                gemm, weights_of_kind = cpu.int8_gemm, packs["int8"]
            elif kind == "onednn":
                gemm, weights_of_kind = onednn_gemm, onednn
            else:
                gemm, weights_of_kind = float_gemm(kind, dtype, m)
            inputs = [x.to(dtype) for x in xs]

            def run():
                for x, packed in zip(inputs, weights_of_kind):
                    gemm(x, packed)
            run()
            best = math.inf
            for _ in range(repeats):
                begin = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - begin)
            times.append(best * 1e3 / copies)
        results.append((m, *times))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.int8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    quality = sub.add_parser("quality", help="perplexity fp32 / bf16 / int8 and greedy agreement")
    quality.add_argument("--windows", type=int, default=8, help="corpus windows scored (default 8)")
    quality.add_argument("--window-tokens", type=int, default=512, help="tokens per window (default 512)")
    quality.add_argument("--max-tokens", type=int, default=48, help="greedy output tokens per prompt (default 48)")
    quality.add_argument("--llamacpp", action="store_true",
                         help="also llama.cpp's perplexity with bf16, Q8_0 and Q4_0 weights (builds llama.cpp once)")
    gemm = sub.add_parser("gemm", help="one decoder layer's GEMMs: int8 vs bf16 vs fp32 weights")
    gemm.add_argument("--shape", default="smollm2-1.7b", help="a shape of benchmarks.shapes (default smollm2-1.7b)")
    gemm.add_argument("--rows", default="1,4,16,64", help="comma-separated row counts (default 1,4,16,64)")
    gemm.add_argument("--repeats", type=int, default=5, help="timed runs, the best kept (default 5)")
    args = parser.parse_args(argv)
    if args.command == "quality":
        windows = corpus_windows(args.windows, args.window_tokens)
        runs = [("fp32", "float32", "none"), ("bf16", "bfloat16", "none"), ("fp32 + int8 weights", "float32", "int8")]
        if int8_activations() == "bfloat16":
            runs.insert(2, ("bf16 + int8 weights", "bfloat16", "int8"))
        from kernels import cpu

        quantizations = ["int8", "w8a8"] if cpu.w8a8_gemm_available() else ["int8"]
        if "w8a8" in quantizations:
            runs += [(label.replace("int8 weights", "w8a8"), dtype, "w8a8") for label, dtype, q in runs if q == "int8"]
        for label, dtype, quantization in runs:
            print(f"perplexity {label}: {perplexity(quantization, dtype, windows):.4f}")
        dtype = int8_activations()
        for quantization in quantizations:
            same, total, diverged = greedy_agreement(args.max_tokens, dtype, quantization)
            print(f"greedy {quantization} vs {dtype} weights ({dtype} activations): identical {same} of {total}; "
                  f"first divergence at output tokens {diverged}")
        if args.llamacpp:
            llamacpp_quality(args.windows, args.window_tokens)
    else:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
        print(f"one layer of {args.shape}, ms (best of {args.repeats}, {torch.get_num_threads()} threads)")
        print(f"rows  w8a8   int8 ({int8_activations()} activations)   bf16   fp32   fp32 oneDNN   "
              "fp32 / oneDNN speed   int8 / w8a8 speed")
        for m, w8a8_ms, int8_ms, bf16_ms, fp32_ms, onednn_ms in layer_gemm_ms(args.shape, rows, args.repeats):
            w8a8 = "   n/a" if w8a8_ms is None else f"{w8a8_ms:6.2f}"
            gain = "  n/a" if w8a8_ms is None else f"{int8_ms / w8a8_ms:5.2f}x"
            print(f"{m:4d} {w8a8} {int8_ms:6.2f} {bf16_ms:6.2f} {fp32_ms:6.2f} {onednn_ms:6.2f} "
                  f"{onednn_ms / fp32_ms:5.2f}x {gain}")


if __name__ == "__main__":
    main()
