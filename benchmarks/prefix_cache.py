"""Shared-prefix workload: prefix caching on vs off, same requests, same engine settings.

A long system prompt (512 tokens by default) followed by a short question (16-32 tokens), short
answers; requests arrive one after another, so TTFT is the prefill cost a user sees. With caching on,
every request after the first finds the system prompt's full blocks in the pool and prefills only its
question (vLLM's automatic prefix caching is the reference design).
"""

from __future__ import annotations

import random
import statistics
import time

from backend import EngineConfig, LLMEngine, SamplingParams
from benchmarks.config import BenchConfig
from benchmarks.workload import corpus_text


def shared_prefix_prompts(tokenizer, num_requests: int, prefix_tokens: int, seed: int) -> list[list[int]]:
    """``num_requests`` prompts: the same ``prefix_tokens``-token system prompt, then 16-32 tokens of question."""
    ids = tokenizer.encode(corpus_text())
    rng = random.Random(seed)
    prefix = ids[:prefix_tokens]
    prompts = []
    for _ in range(num_requests):
        start = rng.randrange(prefix_tokens, len(ids) - 64)
        prompts.append(prefix + ids[start:start + rng.randint(16, 32)])
    return prompts


def _run(config: BenchConfig, prompts: list[list[int]], caching: bool, max_tokens: int) -> dict:
    engine = LLMEngine(EngineConfig(model=config.model, num_threads=config.threads, max_num_seqs=config.max_num_seqs,
                                    max_num_batched_tokens=config.max_num_batched_tokens,
                                    block_size=config.block_size, kv_cache_memory_bytes=config.kv_cache_bytes,
                                    enable_prefix_caching=caching))
    try:
        list(engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0.0)))  # warm-up, untimed
        ttfts, cached, tokens = [], [], 0
        began = time.perf_counter()
        for prompt in prompts:  # one after another: TTFT is this request's own prefill
            outs = list(engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               ignore_eos=True)))
            last = outs[-1]
            ttfts.append(last.metrics.time_to_first_token)
            cached.append(last.num_cached_tokens)
            tokens += last.num_output_tokens
        elapsed = time.perf_counter() - began
        kv = engine.stats().kv
    finally:
        engine.shutdown()
    ttfts.sort()
    return {"prefix_caching": caching, "requests": len(prompts), "output_tokens": tokens,
            "output_tokens_per_s": tokens / elapsed, "requests_per_s": len(prompts) / elapsed,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "mean_cached_tokens": statistics.mean(cached), "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits}


def run_prefix_cache(config: BenchConfig, tokenizer, num_requests: int = 12, prefix_tokens: int = 512,
                     max_tokens: int = 16) -> dict:
    """Both runs and their ratios: TTFT p50 off / on, throughput on / off."""
    prompts = shared_prefix_prompts(tokenizer, num_requests, prefix_tokens, config.seed)
    off = _run(config, prompts, caching=False, max_tokens=max_tokens)
    on = _run(config, prompts, caching=True, max_tokens=max_tokens)
    return {"workload": {"requests": num_requests, "prefix_tokens": prefix_tokens, "question_tokens": [16, 32],
                         "max_tokens": max_tokens, "seed": config.seed, "arrivals": "sequential"},
            "off": off, "on": on,
            "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
            "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"]}


def markdown(result: dict) -> list[str]:
    w = result["workload"]
    lines = ["", "## Prefix caching: shared system prompt", "",
             f"{w['requests']} requests, one after another: the same {w['prefix_tokens']}-token system prompt, "
             f"then a {w['question_tokens'][0]}-{w['question_tokens'][1]}-token question; {w['max_tokens']} output "
             f"tokens each (greedy, `ignore_eos`); seed {w['seed']}.", "",
             "| Prefix caching | TTFT p50 / p99 (s) | Tokens/s | Req/s | Mean cached prompt tokens | Hits / queries (tokens) |",
             "|---|---:|---:|---:|---:|---:|"]
    for key in ("off", "on"):
        r = result[key]
        lines.append(f"| {key} | {r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['requests_per_s']:.3f} | {r['mean_cached_tokens']:.0f} | "
                     f"{r['prefix_cache_hits']} / {r['prefix_cache_queries']} |")
    met = "yes" if result["ttft_p50_speedup"] >= 3 else "**no**"
    lines += ["", f"TTFT p50 with caching is {result['ttft_p50_speedup']:.1f}x lower (target >= 3x: {met}); "
              f"throughput {result['throughput_ratio']:.2f}x."]
    return lines
