"""The forward-only ceiling: what the model alone costs per decode step at a given batch and context, and per
prompt token of a prefill.

Decode: plain transformers forward passes with its own ``DynamicCache``: prefill one row of ``context`` real
text tokens, repeat that cache to ``batch`` rows (untimed; the values do not change the cost), then time decode
steps of one token per row. No scheduling, sampling beyond argmax, detokenization or padding: an engine at this
batch size cannot beat ``batch / step time`` tokens/s in decode.

Our engine at the same shape: ``batch`` requests of ``context`` prompt tokens each, prefilled untimed, then whole
``LLMEngine.step`` calls timed (scheduler, forward, sampler, detokenizer): the engine's own per-step efficiency,
free of the workload's varying batch size and of prefill.

Prefill: forward passes over ``rows`` equal-length prompts of real text (no padding, logits of the last token
only), about one step's token budget in all. An engine also computes every prompt token once, so the work-matched
ceiling of a run is ``output_tokens / (output_tokens / decode tokens/s + prompt_tokens * prefill s/token)``.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from transformers import DynamicCache

from backend import EngineConfig, LLMEngine, SamplingParams
from benchmarks.engine_system import step_until_all_decoding
from benchmarks.hf_baselines import load_hf_model

WARMUP_STEPS = 2


@torch.inference_mode()
def measure_ceiling(model_dir: str, batch: int, context: int, steps: int, token_ids: list[int]) -> dict:
    """Decode throughput of the bare model.

    Args:
        batch: rows per forward pass.
        context: tokens already in each row's cache when timing starts.
        steps: timed decode steps (after ``WARMUP_STEPS`` untimed ones).
        token_ids: real text tokens to fill the prompt with (cycled).

    Returns:
        ``batch``, ``context``, ``step_s`` (median seconds per decode step) and ``output_tokens_per_s``.
    """
    model = load_hf_model(model_dir)
    prompt = [token_ids[i % len(token_ids)] for i in range(context)]
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(batch)
    next_ids = out.logits[:, -1:].argmax(-1).repeat(batch, 1)
    times = []
    for step in range(WARMUP_STEPS + steps):
        begin = time.perf_counter()
        out = model(input_ids=next_ids, past_key_values=cache, use_cache=True)
        next_ids = out.logits[:, -1:].argmax(-1)
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - begin)
    del model, cache
    step_s = _median(times)
    return {"batch": batch, "context": context, "steps": steps, "step_s": step_s,
            "output_tokens_per_s": batch / step_s}


def measure_engine_step(engine_config: EngineConfig, batch: int, context: int, steps: int,
                        token_ids: list[int]) -> dict:
    """Decode step time of our engine at the ceiling's batch and context.

    Args:
        engine_config: the benchmark's engine settings; ``max_num_seqs`` is raised to ``batch`` if lower.
        batch / context / steps / token_ids: as :func:`measure_ceiling` (each row a different slice of text).

    Returns:
        ``engine_step_s`` (median seconds per step) and ``engine_output_tokens_per_s``.
    """
    config = dataclasses.replace(engine_config, max_num_seqs=max(batch, engine_config.max_num_seqs))
    engine = LLMEngine(config)
    prefill_steps = -(-batch * context // config.max_num_batched_tokens)  # rows admitted first decode meanwhile
    params = SamplingParams(max_tokens=prefill_steps + WARMUP_STEPS + steps + 2, temperature=0.0, ignore_eos=True)
    times = []
    try:
        for row in range(batch):
            engine.add_request([token_ids[(row * 7 + i) % len(token_ids)] for i in range(context)], params)
        step_until_all_decoding(engine)  # untimed: admit and prefill every row
        for step in range(WARMUP_STEPS + steps):
            begin = time.perf_counter()
            engine.step()
            if step >= WARMUP_STEPS:
                times.append(time.perf_counter() - begin)
            stats = engine.stats()
            if stats.last_step_num_scheduled != batch or stats.last_step_num_prefills:
                raise RuntimeError(f"engine step ran {stats.last_step_num_scheduled} requests "
                                   f"({stats.last_step_num_prefills} prefilling), not {batch} decodes")
    finally:
        engine.shutdown()
    step_s = _median(times)
    return {"engine_step_s": step_s, "engine_output_tokens_per_s": batch / step_s}


@torch.inference_mode()
def measure_prefill(model_dir: str, length: int, rows: int, repeats: int, token_ids: list[int]) -> dict:
    """Prefill cost of the bare model.

    Args:
        length: tokens per prompt.
        rows: prompts per forward pass (each a different slice of ``token_ids``).
        repeats: timed forward passes (after one untimed).

    Returns:
        ``prefill_length``, ``prefill_rows`` and ``prefill_s_per_token`` (median pass / (rows * length)).
    """
    model = load_hf_model(model_dir)
    ids = torch.tensor([[token_ids[(r * length + i) % len(token_ids)] for i in range(length)] for r in range(rows)])
    times = []
    for repeat in range(1 + repeats):
        begin = time.perf_counter()
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
        if repeat:
            times.append(time.perf_counter() - begin)
    del model
    return {"prefill_length": length, "prefill_rows": rows, "prefill_s_per_token": _median(times) / (rows * length)}


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]  # robust to other load on the machine


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.ceiling --batch B --context C [--steps K]``: the bare forward's decode step and our
    engine's whole step at that shape, side by side (the benchmark's engine settings, default model)."""
    import argparse

    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir
    from benchmarks.config import BenchConfig
    from benchmarks.engine_system import engine_config
    from benchmarks.workload import corpus_text

    parser = argparse.ArgumentParser(prog="python -m benchmarks.ceiling", description=main.__doc__)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    for name in ("batch", "context", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    config = BenchConfig()
    torch.set_num_threads(config.threads)
    model_dir = str(resolve_model_dir(None))
    text_ids = AutoTokenizer.from_pretrained(model_dir).encode(corpus_text()[:20_000])
    try:  # ours first: a context the engine rejects (over max_model_len) fails before the long bare prefill
        ours = measure_engine_step(engine_config(config), args.batch, args.context, args.steps, text_ids)
    except ValueError as exc:
        parser.error(str(exc))
    bare = measure_ceiling(model_dir, args.batch, args.context, args.steps, text_ids)
    print(f"batch {args.batch}, context {args.context}, {config.threads} threads: bare forward "
          f"{bare['step_s'] * 1e3:.0f} ms/step ({bare['output_tokens_per_s']:.1f} tokens/s), our engine's step "
          f"{ours['engine_step_s'] * 1e3:.0f} ms ({ours['engine_output_tokens_per_s']:.1f} tokens/s): "
          f"efficiency {bare['step_s'] / ours['engine_step_s']:.0%} (bare step time / our step time)")


if __name__ == "__main__":
    main()
