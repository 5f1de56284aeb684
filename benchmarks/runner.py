"""Runs every selected system on one workload, one after another in this process, and writes the report.

Each system is built (model loaded, warmed up), run once per mode, then closed before the next is built,
so no two systems compete for the CPU. A system that cannot start is reported as skipped, with the reason.

Everything here that runs torch on the thread that calls it (the machine's limits and rate probes, the transformers
baselines, the ceilings) runs on a thread of its own that ends with it (:func:`backend.cpu_threads.run_on_fresh_thread`):
OpenMP keeps a pool of workers for each thread that ever ran a parallel region, and one left on this thread while
our engine steps on its loop thread puts every barrier of every step to sleep (:mod:`backend.cpu_threads`), which
measures the engine slower than it serves. Our engine loads and steps on threads of its own and the peers run in
processes of their own, so those systems run on this thread, where Ctrl-C reaches them and they close at once.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from backend.cpu_threads import run_on_fresh_thread
from backend.model_loader import resolve_model_dir
from benchmarks.ceiling import measure_ceiling, measure_engine_step, measure_prefill
from benchmarks.config import HF_BASELINES, MODES, BenchConfig
from benchmarks.engine_system import engine_config
from benchmarks.machine import load_average, machine_info
from benchmarks.records import summarize
from benchmarks.report import build_report, markdown, write_json
from benchmarks.workload import Workload, corpus_text, make_workload

log = logging.getLogger("benchmarks")


def _build(name: str, config: BenchConfig, model_dir: str, workload: Workload, pad: int):
    if name == "naive":
        from benchmarks.hf_baselines import NaiveSystem
        return NaiveSystem(config, model_dir, pad)
    if name == "static":
        from benchmarks.hf_baselines import StaticSystem
        return StaticSystem(config, model_dir, pad)
    if name == "generate_batch":
        from benchmarks.hf_continuous import GenerateBatchSystem
        return GenerateBatchSystem(config, model_dir, workload)
    if name == "engine":
        from benchmarks.engine_system import EngineSystem
        return EngineSystem(config)
    if name == "vllm":
        from backend.config import resolve_dtype
        from benchmarks.vllm_system import VllmSystem
        return VllmSystem(config, model_dir, resolve_dtype(config.dtype, "cpu"), max_model_len(model_dir))
    if name == "llamacpp":
        from backend.config import resolve_dtype
        from benchmarks.llamacpp_system import LlamaCppSystem
        return LlamaCppSystem(config, model_dir, resolve_dtype(config.dtype, "cpu"), workload)
    if name == "server":
        from benchmarks.server_system import ServerSystem
        return ServerSystem(config)
    raise ValueError(name)


def run_benchmark(config: BenchConfig, command: str | None = None) -> dict:
    """Measures, writes ``report.json``, ``report.md`` and the PNGs into ``config.output_dir``; returns the report.

    Args:
        command: the command line that asked for this run, recorded in the report.
    """
    torch.set_num_threads(config.threads)
    began = time.perf_counter()
    machine = machine_info(config.threads)
    if config.shape:
        from benchmarks.shapes import SHAPES, ensure_shape

        if config.shape not in SHAPES:
            raise ValueError(f"unknown shape {config.shape!r}; known: {', '.join(SHAPES)}")
        config = dataclasses.replace(config, model=str(ensure_shape(config.shape)))
    model_dir = str(resolve_model_dir(config.model))
    limits = None
    if config.limits:
        from backend.config import resolve_dtype
        from benchmarks.limits import model_limits

        limits = run_on_fresh_thread(lambda: model_limits(model_dir, resolve_dtype(config.dtype, "cpu"),
                                                          config.threads, config.quantization))
        torch.set_num_threads(config.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = make_workload(tokenizer, config)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runs, skipped = [], {}

    names = [s for s in config.systems if s not in ("ceiling", "prefix_cache")]

    def ceilings() -> list[dict]:
        return run_on_fresh_thread(lambda: _ceilings(config, model_dir, tokenizer, workload, runs))

    for round_index in range(config.rounds):
        for name in names:
            if name not in skipped:
                run = functools.partial(_run_system, name, round_index, config, model_dir, workload, pad, skipped)
                runs += run_on_fresh_thread(run) if name in HF_BASELINES else run()
            if name == "engine" and "ceiling" in config.systems and round_index == 0:  # right after: the same load
                runs += ceilings()
    if "ceiling" in config.systems and not any(r["system"] == "ceiling" for r in runs):
        runs += ceilings()

    from backend.config import resolve_dtype

    settings = {**config.as_dict(), "dtype_resolved": resolve_dtype(config.dtype, "cpu"),  # what "auto" was here
                "engine_malloc": os.environ.get("LLM_BENCH_MALLOC", "glibc malloc"),
                "parts_on_own_threads": True}  # see the module docstring; older reports ran them on this thread
    report = build_report(settings, machine, workload.summary(), runs, skipped)
    if limits is not None:
        report["limits"] = limits
    if "prefix_cache" in config.systems:
        from benchmarks.prefix_cache import run_prefix_cache

        log.info("prefix_cache: starting")
        report["prefix_cache"] = run_prefix_cache(config, tokenizer, num_requests=6 if config.quick else 12)
        log.info("prefix_cache: TTFT p50 %.1fx lower with caching", report["prefix_cache"]["ttft_p50_speedup"])
    report["machine"]["loadavg_at_end"] = load_average()
    report["command"] = command
    report["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    report["wall_s"] = time.perf_counter() - began
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.plots import write_plots  # matplotlib only when writing
    report["files"] = [str(p) for p in [out / "report.json", out / "report.md", *write_plots(report, out)]]
    write_json(report, out / "report.json")
    (out / "report.md").write_text(markdown(report))
    return report


def _run_system(name: str, round_index: int, config: BenchConfig, model_dir: str, workload: Workload, pad: int,
                skipped: dict[str, str]) -> list[dict]:
    """Builds ``name``, runs it once per mode, closes it; its summaries (``round`` set), or none with the reason in
    ``skipped``."""
    log.info("%s: starting%s", name, f" (round {round_index + 1} of {config.rounds})" if config.rounds > 1 else "")
    probe = _probe_machine(config) if config.rounds > 1 else None  # before the build: nothing of ours running
    try:
        system = _build(name, config, model_dir, workload, pad)
    except Exception as exc:  # e.g. no tritonserver here: say so and go on
        skipped[name] = f"could not start: {_one_line(exc)}"
        log.warning("%s skipped: %s", name, skipped[name])
        _release()  # what a half-built system took
        return []
    runs = []
    try:
        for mode in [m for m in config.modes if m in getattr(system, "modes", MODES)]:
            requests = workload.head(config.max_requests(name, mode))
            load_before = load_average()
            summary = summarize(system.run(requests, mode))
            summary.update(loadavg_before=load_before, loadavg_after=load_average(), round=round_index)
            if probe is not None:
                summary["machine_gflops_before"] = probe
            if len(requests.requests) < len(workload.requests):
                summary["notes"].append(f"{mode}: ran the first {len(requests.requests)} of "
                                        f"{len(workload.requests)} requests (by arrival); figures are over "
                                        f"those, not extrapolated")
            runs.append(summary)
            log.info("%s %s: %.1f tokens/s", name, mode, summary["output_tokens_per_s"])
    except Exception as exc:  # keep what the other systems measured; the report says what failed
        log.exception("%s failed", name)
        skipped[name] = f"failed: {_one_line(exc)}"
    finally:
        try:
            system.close()
        finally:
            del system
            _release()
    return runs


def _release() -> None:
    """What a closed system freed, back to the OS before the next one starts (tcmalloc keeps freed memory: an fp32
    1.7B engine left 11 GB resident after closing, and vLLM could not allocate its KV cache)."""
    from backend.host_memory import release_free_memory

    gc.collect()
    release_free_memory()


def _probe_machine(config: BenchConfig) -> dict | None:
    """The machine's matmul rate before a system's round (:mod:`benchmarks.steadiness`), sampled before the system
    is built, so with nothing else of ours running; every mode of that round carries it. None (logged) when the
    probe fails: the round runs without it."""
    from backend.config import resolve_dtype
    from benchmarks.steadiness import PROBE_N, PROBE_SECONDS, sample_gemm_rate, summarize_rates

    dtype = resolve_dtype(config.dtype, "cpu")
    try:  # on a thread of its own: its OpenMP pool ends with it (see the module docstring)
        rates = summarize_rates(run_on_fresh_thread(
            lambda: sample_gemm_rate(dtype, config.threads, seconds=PROBE_SECONDS)))
    except Exception as exc:
        log.warning("machine probe failed, the round runs without it: %s", _one_line(exc))
        return None
    finally:
        torch.set_num_threads(config.threads)
    log.info("machine before the round: %s matmul %.0f-%.0f GFLOP/s (median %.0f)", dtype, rates["min"],
             rates["max"], rates["median"])
    return {**rates, "dtype": dtype, "n": PROBE_N, "seconds": PROBE_SECONDS}


def max_model_len(model_dir: str) -> int:
    """The engine's default for this model (its limit, capped as the engine caps it), given to vLLM too."""
    from transformers import AutoConfig

    from backend.model_support import default_max_model_len

    return default_max_model_len(AutoConfig.from_pretrained(model_dir))


def _one_line(exc: Exception) -> str:
    """The first and last lines of an error (a server's start-up failure carries its whole log)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _ceilings(config: BenchConfig, model_dir: str, tokenizer, workload: Workload, runs: list[dict]) -> list[dict]:
    """The forward-only ceiling per mode, at our engine's mean batch in that mode (measured once per batch size),
    and the work-matched ceiling of the requests the engine ran in that mode (their prompts prefilled too)."""
    context = round(workload.mean_decode_context())
    text_ids = tokenizer.encode(corpus_text()[:20_000])
    prompt_len = max(1, round(workload.total_prompt_tokens / len(workload.requests)))
    prefill = measure_prefill(model_dir, prompt_len, max(1, config.max_num_batched_tokens // prompt_len),
                              config.ceiling_steps // 4 + 1, text_ids)
    measured: dict[int, dict] = {}
    out = []
    for mode in config.modes:
        engine = next((r for r in runs if r["system"] == "engine" and r["mode"] == mode), None)
        batch = max(1, round(engine["mean_batch"])) if engine else min(config.num_requests, config.max_num_seqs)
        if batch not in measured:
            measured[batch] = {**measure_ceiling(model_dir, batch, context, config.ceiling_steps, text_ids),
                               **measure_engine_step(engine_config(config), batch, context, config.ceiling_steps,
                                                     text_ids)}
        decode = measured[batch]
        served = workload.head(config.max_requests("engine", mode))
        outputs, prompts = served.total_output_tokens, served.total_prompt_tokens
        seconds = outputs / decode["output_tokens_per_s"] + prompts * prefill["prefill_s_per_token"]
        source = "our engine's mean batch" if engine else "min(num_requests, max_num_seqs): engine not run"
        out.append({"system": "ceiling", "mode": mode, **decode, **prefill,
                    "work": {"output_tokens": outputs, "prompt_tokens": prompts},
                    "with_prefill_tokens_per_s": outputs / seconds,
                    "notes": [f"batch = {source}; context = workload's mean decode context; median step",
                              f"our engine's whole step at that batch and context: "
                              f"{decode['engine_step_s'] * 1e3:.0f} ms",
                              f"with prefill: the engine's {outputs} output tokens at the decode ceiling plus its "
                              f"{prompts} prompt tokens at the bare prefill cost ({prefill['prefill_rows']} rows of "
                              f"{prompt_len} tokens per pass)"]})
    log.info("ceiling: %s", ", ".join(f"{r['mode']} {r['output_tokens_per_s']:.1f} tokens/s decode only, "
                                      f"{r['with_prefill_tokens_per_s']:.1f} with prefill" for r in out))
    return out
