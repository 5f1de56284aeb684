"""The step time budget (``max_step_ms``) at a busy closed loop: TTFT, ITL and tokens/s per budget.

``python -m benchmarks.step_budget [--shape smollm2-1.7b | --model DIR] [--dtype bfloat16] [--budgets 0,50,500]
[--concurrency 16] [--num-requests 32] [--rounds 2] [--threads N] [--output-dir results/step-budget]``

Our engine in process (``benchmarks.engine_system``, with the allocator the served engine gets, as ``python -m
benchmarks`` runs it; the matrix's settings but ``max_step_ms``) serves the quick workload's requests in the closed
loop, ``concurrency`` in flight, once per budget and round, the budgets in turn each round (a machine whose speed
drifts moves neighbouring runs together). Each run builds its engine afresh; its
warm-up request gives the step cost fit its first steps, as a served model's first requests would. The first
``concurrency`` requests arrive at once, so TTFT falls in two groups (that burst, and the requests sent as slots
free); the report gives the TTFT mean beside p50 and p99 for that reason, and the burst's mean on its own.

The trade it shows: a budget bounds the gaps in running streams (ITL p99) and spreads prompts over more steps
(TTFT). Writes ``report.json`` under the output directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.config import QUICK, BenchConfig
from benchmarks.machine import load_average, machine_info

FIGURES = ("output_tokens_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "burst_ttft_mean_s", "itl_p50_ms",
           "itl_p99_ms")


def run_once(config: BenchConfig, workload) -> dict:
    """One engine with ``config``'s budget, built, run in the closed loop over ``workload``, closed."""
    from backend.host_memory import release_free_memory
    from benchmarks.engine_system import EngineSystem
    from benchmarks.records import summarize

    system = EngineSystem(config)
    try:
        run = system.run(workload, "concurrent")
    finally:
        system.close()
        gc.collect()
        release_free_memory()
    s = summarize(run)
    if s["output_tokens"] != s["expected_tokens"]:
        raise RuntimeError(f"max_step_ms {config.max_step_ms}: {s['output_tokens']} tokens, expected "
                           f"{s['expected_tokens']}")
    burst = [r.ttft for r in run.records if r.index < config.concurrency]
    return {"max_step_ms": config.max_step_ms, "output_tokens_per_s": s["output_tokens_per_s"],
            "ttft_mean_s": s["ttft_s_mean"], "ttft_p50_s": s["ttft_s_p50"], "ttft_p99_s": s["ttft_s_p99"],
            "burst_ttft_mean_s": statistics.fmean(burst), "itl_p50_ms": s["itl_ms_p50"],
            "itl_p99_ms": s["itl_ms_p99"], "steps": len(run.timeline["t_s"])}


def summarize_budgets(runs: list[dict]) -> list[dict]:
    """Per budget (in first-seen order): the median of each figure over its rounds, and the rounds' range."""
    rows = []
    for budget in dict.fromkeys(r["max_step_ms"] for r in runs):
        mine = [r for r in runs if r["max_step_ms"] == budget]
        row = {"max_step_ms": budget, "rounds": len(mine)}
        for name in FIGURES:
            values = [r[name] for r in mine]
            row[name] = statistics.median(values)
            row[f"{name}_range"] = [min(values), max(values)]
        rows.append(row)
    return rows


def page_markdown(report: dict) -> str:
    """The per-budget medians as a table (``benchmarks.docs_page``)."""
    c = report["config"]
    lines = [f"{c['shape'] or c['model']}, {c['dtype']}, {c['concurrency']} streams, {c['num_requests']} requests, "
             f"{c['rounds']} round(s) per budget, the engine on {c.get('engine_malloc', 'an unrecorded allocator')}; "
             "medians (range over rounds):", "",
             "| max_step_ms | tokens/s | TTFT mean (s) | TTFT p50 / p99 (s) | burst TTFT mean (s) "
             "| ITL p50 / p99 (ms) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in report["budgets"]:
        rng = lambda name, f: "-".join(f.format(v) for v in r[f"{name}_range"])  # noqa: E731
        lines.append(f"| {r['max_step_ms']:g} | {r['output_tokens_per_s']:.1f} ({rng('output_tokens_per_s', '{:.1f}')})"
                     f" | {r['ttft_mean_s']:.2f} ({rng('ttft_mean_s', '{:.2f}')}) | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['burst_ttft_mean_s']:.2f} | {r['itl_p50_ms']:.0f} / "
                     f"{r['itl_p99_ms']:.0f} |")
    return "\n".join(lines) + "\n"


markdown = page_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_budget", description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--shape", help="a model shape with random weights (benchmarks.shapes)")
    where.add_argument("--model", help="a Hugging Face model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--budgets", default="0,50,500", help="comma-separated max_step_ms values (0: none)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests in the workload (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per budget, budgets in turn (default 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output-dir", default="results/step-budget")
    args = parser.parse_args(argv)
    try:
        budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--budgets takes comma-separated numbers, got {args.budgets!r}")
    if not budgets or args.rounds < 1:
        parser.error("give at least one budget and one round")
    if any(not 0 <= b < float("inf") for b in budgets) or len(set(budgets)) < len(budgets):
        parser.error(f"--budgets takes distinct milliseconds >= 0, got {args.budgets!r}")
    if argv is None:  # run as a program (not called by a test): the engine gets the served allocator
        from benchmarks.__main__ import MALLOC_ENV, preload_allocator

        preload_allocator("benchmarks.step_budget", sys.argv[1:])
        malloc = os.environ.get(MALLOC_ENV, "glibc malloc")
    else:
        malloc = "the calling process's allocator"

    import torch
    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir
    from benchmarks.shapes import ensure_shape
    from benchmarks.workload import make_workload

    threads = args.threads or torch.get_num_threads()
    values = {**QUICK, "num_requests": args.num_requests, "concurrency": args.concurrency, "dtype": args.dtype,
              "threads": threads, "progress": False, "systems": ("engine",), "modes": ("concurrent",)}
    if args.shape:
        values.update(model=str(ensure_shape(args.shape)), shape=args.shape)
    elif args.model:
        values["model"] = args.model
    base = BenchConfig(**values, max_step_ms=budgets[0])
    workload = make_workload(AutoTokenizer.from_pretrained(resolve_model_dir(base.model)), base)
    machine = {**machine_info(threads), "loadavg_at_start": load_average()}
    runs = []
    for round_ in range(args.rounds):
        for budget in budgets:
            row = {"round": round_, **run_once(BenchConfig(**values, max_step_ms=budget), workload)}
            print(json.dumps(row), flush=True)
            runs.append(row)
    machine["loadavg_at_end"] = load_average()
    report = {"benchmark": "benchmarks.step_budget", "machine": machine,
              "command": " ".join(["python -m benchmarks.step_budget", *(sys.argv[1:] if argv is None else argv)]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "config": {"shape": args.shape,
                         "model": None if args.shape else args.model or "SmolLM2-135M-Instruct (embedded)",
                         "engine_malloc": malloc, "dtype": args.dtype, "concurrency": args.concurrency,
                         "num_requests": args.num_requests, "rounds": args.rounds, "threads": threads,
                         "budgets": budgets},
              "workload": {k: v for k, v in workload.summary().items() if k != "requests"},
              "runs": runs, "budgets": summarize_budgets(runs)}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(page_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
