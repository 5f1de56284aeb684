"""Where our engine's step time goes, at the largest batch of the offline run (cProfile).

``python -m benchmarks.profile_engine [--num-requests N] [--seed S] [--steps K] [--model DIR]``: the benchmark's
workload is added all at once; steps run unprofiled until every request is admitted (the batch is then at
its largest), and the next K steps run under cProfile (``--skip J`` runs J more steps first: the tail). Prints the split of step time into scheduler, model
runner input preparation, forward, sampler and detokenizer, then the top 15 entries under ``LLMEngine.step``
by cumulative time and by own time, with their share of step time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path

import torch
from transformers import AutoTokenizer

from backend import LLMEngine
from backend.model_loader import resolve_model_dir
from benchmarks.config import BenchConfig
from benchmarks.engine_system import engine_config, greedy, step_until_all_decoding
from benchmarks.workload import make_workload

Key = tuple[str, int, str]  # pstats: (file, line, function)
REPO_ROOT = Path(__file__).resolve().parent.parent


def profile_engine(config: BenchConfig, steps: int, skip: int = 0) -> dict:
    """Profiles ``steps`` engine steps at the largest batch, or ``skip`` steps later (e.g. in the tail of long
    requests at a small batch); returns the batch sizes, the split and the top entries."""
    torch.set_num_threads(config.threads)
    engine = LLMEngine(engine_config(config))
    workload = make_workload(AutoTokenizer.from_pretrained(resolve_model_dir(config.model)), config)
    for r in workload.requests:
        engine.add_request(list(r.prompt_ids), greedy(r.output_len), request_id=str(r.index))
    step_until_all_decoding(engine)  # pure decode at the largest batch from here
    for _ in range(skip):
        engine.step()
    profiler, batches = cProfile.Profile(), []
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        profiler.enable()
        engine.step()
        profiler.disable()
        batches.append(engine.stats().last_step_num_scheduled)
    engine.shutdown()
    if not batches:
        raise ValueError(f"no step left to profile: the {len(workload.requests)} requests finished within --skip "
                         f"{skip} steps of decode")
    stats = pstats.Stats(profiler)
    return {"steps": len(batches), "batch_sizes": batches, **_breakdown(stats), "text": _text(profiler)}


def _find(stats: pstats.Stats, file_end: str, function: str) -> Key | None:
    return next((k for k in stats.stats if k[0].endswith(file_end) and k[2] == function), None)


def _cumulative(stats: pstats.Stats, key: Key | None, caller: Key | None = None) -> float:
    """Cumulative seconds of ``key``, only of its calls from ``caller`` when given."""
    if key is None:
        return 0.0
    _, _, _, cumulative, callers = stats.stats[key]
    if caller is None:
        return cumulative
    return callers.get(caller, (0, 0, 0, 0.0))[3]


def _breakdown(stats: pstats.Stats) -> dict:
    step = _find(stats, "backend/llm_engine.py", "step")
    total = _cumulative(stats, step)
    execute = _find(stats, "backend/model_runner.py", "execute")
    # The decoder's forward: the model's entry points called by the runner (the compact decoder's final_hidden,
    # a transformers module's __call__); the LM head runs inside the sampler (Sampler.from_hidden).
    forward = sum(_cumulative(stats, key, execute) for key in stats.stats
                  if key[2] in ("final_hidden", "_wrapped_call_impl") and execute is not None)
    sampler_key = _find(stats, "backend/sampler.py", "from_hidden") or _find(stats, "backend/sampler.py", "__call__")
    sampler = _cumulative(stats, sampler_key)
    parts = {
        "scheduler": _cumulative(stats, _find(stats, "backend/scheduler.py", "schedule"))
        + _cumulative(stats, _find(stats, "backend/scheduler.py", "update_from_output")),
        "model runner input prep": _cumulative(stats, execute) - forward - sampler,
        "forward (decoder layers)": forward,
        "LM head + sampler": sampler,
        "detokenizer": _cumulative(stats, _find(stats, "backend/detokenizer.py", "add_token"))
        + _cumulative(stats, _find(stats, "backend/detokenizer.py", "delta")),
    }
    parts["other (engine bookkeeping)"] = total - sum(parts.values())
    under = _under(stats, step)
    top = sorted(((k, v[3]) for k, v in stats.stats.items() if k in under), key=lambda kv: -kv[1])
    own = sorted(((k, v[2]) for k, v in stats.stats.items() if k in under), key=lambda kv: -kv[1])
    return {"step_s": total, "split": {name: {"s": s, "share": s / total} for name, s in parts.items()},
            "top": [{"function": _name(k), "cumulative_s": s, "share": s / total} for k, s in top[:15]],
            "top_own": [{"function": _name(k), "own_s": s, "share": s / total} for k, s in own[:15]]}


def _name(key: Key) -> str:
    return f"{key[0].split('site-packages/')[-1].replace(str(REPO_ROOT) + '/', '')}:{key[1]}({key[2]})"


def _under(stats: pstats.Stats, step: Key | None) -> set[Key]:
    """``LLMEngine.step`` and every function it calls, transitively."""
    callees: dict[Key, list[Key]] = {}
    for key, (*_, callers) in stats.stats.items():
        for caller in callers:
            callees.setdefault(caller, []).append(key)
    seen, todo = set(), [step] if step else []
    while todo:
        key = todo.pop()
        if key not in seen:
            seen.add(key)
            todo += callees.get(key, [])
    return seen


def _text(profiler: cProfile.Profile) -> str:
    """The 40 top cumulative entries, as pstats prints them."""
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).sort_stats("cumulative").print_stats(40)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_engine", description=__doc__)
    parser.add_argument("--num-requests", type=int, default=BenchConfig.num_requests)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=20, help="steps to profile")
    parser.add_argument("--skip", type=int, default=0,
                        help="decode steps to run unprofiled first (default 0: profile at the largest batch)")
    parser.add_argument("--model")
    args = parser.parse_args(argv)
    try:
        result = profile_engine(BenchConfig(num_requests=args.num_requests, seed=args.seed, model=args.model),
                                args.steps, args.skip)
    except ValueError as exc:
        parser.error(str(exc))
    batches = result["batch_sizes"]
    print(f"{result['steps']} decode steps at batch {min(batches)}-{max(batches)}, "
          f"{result['step_s'] / result['steps'] * 1e3:.1f} ms per step (under cProfile)\n")
    print("| Part | ms/step | share |\n|---|---:|---:|")
    for name, part in result["split"].items():
        print(f"| {name} | {part['s'] / result['steps'] * 1e3:.1f} | {part['share']:.1%} |")
    print("\n| Cumulative under LLMEngine.step | ms/step | share |\n|---|---:|---:|")
    for entry in result["top"]:
        print(f"| `{entry['function']}` | {entry['cumulative_s'] / result['steps'] * 1e3:.1f} | {entry['share']:.1%} |")
    print("\n| Own time (excluding callees) under LLMEngine.step | ms/step | share |\n|---|---:|---:|")
    for entry in result["top_own"]:
        print(f"| `{entry['function']}` | {entry['own_s'] / result['steps'] * 1e3:.1f} | {entry['share']:.1%} |")


if __name__ == "__main__":
    main()
