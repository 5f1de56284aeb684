"""The report: ratios, targets and consistency checks over the per-run summaries; JSON and markdown."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from benchmarks.config import HF_BASELINES, MODES, SYSTEMS
from benchmarks.machine import features_text

LABELS = {"naive": "naive (HF generate, 1 at a time)", "static": "static batching (HF generate)",
          "generate_batch": "HF continuous batching", "engine": "ours, in process",
          "server": "ours via Triton gRPC", "vllm": "vLLM CPU, in process",
          "llamacpp": "llama.cpp server, HTTP", "ceiling": "ceiling (forward only)"}
# (key, numerator, denominator, target ratio): output tokens/s of one system over another's, per mode;
# "system:field" reads another tokens/s field of that system's run.
RATIOS = (("engine_vs_static", "engine", "static", 4.0), ("engine_vs_generate_batch", "engine", "generate_batch", 3.5),
          ("engine_vs_naive", "engine", "naive", 10.0), ("engine_vs_ceiling", "engine", "ceiling", 0.85),
          ("engine_vs_ceiling_with_prefill", "engine", "ceiling:with_prefill_tokens_per_s", 0.85),
          ("engine_step_vs_ceiling_step", "ceiling:engine_output_tokens_per_s", "ceiling", 0.85),
          ("server_vs_engine", "server", "engine", 0.95), ("engine_vs_vllm", "engine", "vllm", 1.2),
          ("server_vs_vllm", "server", "vllm", 1.2), ("engine_vs_llamacpp", "engine", "llamacpp", 1.0))
KV_WASTE_TARGET_PCT = 4.0
DEFINITIONS = {
    "output_tokens_per_s": "useful output tokens (each request's own length) / (last finish - run start)",
    "requests_per_s": "finished requests / (last finish - run start)",
    "ttft_s": "first token visible to the caller - request arrival; = e2e where the system does not stream",
    "itl_ms": "gaps between consecutive tokens of a request, pooled over requests",
    "e2e_s": "whole answer available - request arrival",
    "mean_batch": "see batch_source per run",
    "kv": "tokens stored / slots reserved = sum(num_computed_tokens) / (used_blocks * block_size), summed over "
          "per-step samples; waste = 1 - that",
    "engine_vs_ceiling": "engine efficiency: our tokens/s over the forward-only decode ceiling at our mean batch "
                         "(decode only: our run also prefills every prompt, which this ceiling does not)",
    "engine_step_vs_ceiling_step": "the ceiling's decode step time over our engine's whole step at the same batch "
                                   "and context (no prefill, no varying batch: the engine's own overhead)",
    "engine_vs_ceiling_with_prefill": "our tokens/s over the work-matched ceiling: the same output tokens at the "
                                      "decode ceiling plus the same prompt tokens at the bare model's prefill cost",
    "server_vs_engine": "offline, the server answers whole (stream false, a batch client's way) unless the run was "
                        "made with --served-offline-stream; online and concurrent runs stream every token",
    "targets": "judged on the offline runs (online throughput is bounded by the arrival rate); KV waste on all",
}


def build_report(config: dict, machine: dict, workload: dict, runs: list[dict], skipped: dict[str, str]) -> dict:
    """The report's data. With several rounds (``run["round"]``), each ratio is the median of the rounds' own
    ratios (``ratios_by_round`` lists them), each taken between runs made minutes apart."""
    runs = sorted(runs, key=lambda r: (SYSTEMS.index(r["system"]), MODES.index(r["mode"]), r.get("round", 0)))
    modes = list(dict.fromkeys(run["mode"] for run in runs))
    by_round = {mode: _ratios_by_round(runs, mode) for mode in modes}
    ratios = {mode: {key: _median(values) for key, values in by_round[mode].items()} for mode in modes}
    report = {"config": config, "machine": machine, "workload": workload, "runs": runs, "skipped": skipped,
              "ratios": ratios, "spread": spread(runs), "targets": _targets(runs, ratios),
              "checks": _checks(runs, workload), "definitions": DEFINITIONS}
    if _num_rounds(runs) > 1:
        report["ratios_by_round"] = by_round
    return report


MIN_ROUNDS_FOR_SPREAD = 3


def spread(runs: list[dict]) -> dict:
    """Per mode and system (the ceiling aside): its tokens/s in each round, their median, and the spread
    ``(max - min) / median`` in percent, the run-to-run variation a single figure of that system carries on
    this machine (None with fewer than :data:`MIN_ROUNDS_FOR_SPREAD` rounds)."""
    out: dict[str, dict[str, dict]] = {}
    for run in runs:
        if run["system"] != "ceiling":
            entry = out.setdefault(run["mode"], {}).setdefault(run["system"], {"tokens_per_s": []})
            entry["tokens_per_s"].append(run["output_tokens_per_s"])
            if run.get("machine_gflops_before"):  # the machine's own matmul rate before the system's round
                entry.setdefault("machine_gflops_before", []).append(run["machine_gflops_before"])
    for systems in out.values():
        for entry in systems.values():
            values = entry["tokens_per_s"]
            median = statistics.median(values)
            entry.update(median=median, min=min(values), max=max(values),
                         spread_pct=100 * (max(values) - min(values)) / median
                         if len(values) >= MIN_ROUNDS_FOR_SPREAD and median else None)
    return out


def _num_rounds(runs: list[dict]) -> int:
    return 1 + max((r.get("round", 0) for r in runs), default=0)


def _tokens_per_s(runs: list[dict], system: str, mode: str, round_index: int) -> float | None:
    """``system``'s tokens/s in ``mode`` and that round (a run without one, the ceiling's, counts in every round)."""
    system, _, field = system.partition(":")
    for run in runs:
        if run["system"] == system and run["mode"] == mode and run.get("round", round_index) == round_index:
            return run[field or "output_tokens_per_s"]
    return None


def _ratios_by_round(runs: list[dict], mode: str) -> dict[str, list[float]]:
    """Per ratio, its value in each round where both systems ran."""
    out = {}
    for key, num, den, _ in RATIOS:
        values = []
        for round_index in range(_num_rounds(runs)):
            a, b = _tokens_per_s(runs, num, mode, round_index), _tokens_per_s(runs, den, mode, round_index)
            if a and b:
                values.append(a / b)
        out[key] = values
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _targets(runs: list[dict], ratios: dict) -> list[dict]:
    offline = ratios.get("offline", {})
    targets = [{"name": key, "target": f">= {goal:g}x" if goal >= 1 else f">= {goal:.0%}", "value": offline.get(key),
                "met": None if offline.get(key) is None else offline[key] >= goal} for key, _, _, goal in RATIOS]
    for run in runs:
        if run.get("kv"):
            waste = run["kv"]["waste_pct"]
            targets.append({"name": f"kv_waste_pct ({run['mode']})", "target": f"< {KV_WASTE_TARGET_PCT:g}%",
                            "value": waste, "met": waste < KV_WASTE_TARGET_PCT})
    return targets


def _checks(runs: list[dict], workload: dict) -> dict:
    """Every system produced exactly the workload's output lengths (naive: over the requests it ran)."""
    served = [r for r in runs if r["system"] != "ceiling"]
    name = lambda r: f"{r['system']}/{r['mode']}" + (f"/round {r['round'] + 1}" if r.get("round") else "")  # noqa: E731
    exact = {name(r): r["output_tokens"] == r["expected_tokens"] for r in served}
    full = {name(r): r["expected_tokens"] == workload["total_output_tokens"] for r in served}
    return {"tokens_exact": exact, "covers_whole_workload": full, "all_tokens_exact": all(exact.values()),
            "same_first_tokens_as_vllm": _agreement(runs, "vllm"),
            "same_first_tokens_as_llamacpp": _agreement(runs, "llamacpp")}


AGREEMENT_PEERS = {"vllm": "vLLM", "llamacpp": "llama.cpp"}


def _agreement(runs: list[dict], peer_name: str) -> dict:
    """Per mode: of the requests both our engine and ``peer_name`` ran (with all 16 token ids known), how many got
    the same first 16 greedy tokens (the first round's runs)."""
    out = {}
    for mode in MODES:
        ours, peer = (next((r.get("first_tokens") for r in runs if r["system"] == s and r["mode"] == mode), None)
                      for s in ("engine", peer_name))
        if ours and peer:
            common = set(ours) & set(peer)
            out[mode] = {"requests": len(common), "same": sum(ours[k] == peer[k] for k in common)}
    return out


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, default=_jsonable))


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def markdown(report: dict) -> str:
    """The tables and notes a reader needs; the JSON holds everything."""
    w, m, c = report["workload"], report["machine"], report["config"]
    lines = [
        "# Engine vs. what a user would otherwise run",
        "",
        *([f"Command: `{report['command']}`", ""] if report.get("command") else []),
        f"Workload: {w['num_requests']} requests, seed {w['seed']}; prompt tokens {_range(w['prompt_tokens'])}, "
        f"output tokens {_range(w['output_tokens'])} ({w['total_output_tokens']} in all, `ignore_eos`); offline = all "
        f"at t=0, online = Poisson at {w['online_rate_rps']:g} req/s "
        f"(last arrival {w['online_last_arrival_s']:.1f} s), "
        f"concurrent = {c.get('concurrency')} in flight (a closed loop: each request sent when one ends; latencies "
        f"count from then; the serving systems only). "
        f"Mean decode context {w['mean_decode_context_tokens']:g} tokens.",
        f"Machine: {m['cpu_model']} ({features_text(m)}; L3 {m.get('l3_cache') or 'unknown'}), "
        f"{m['usable_cpus']} usable CPUs, {m.get('memory_gib')} GiB, torch threads {m['torch_threads']} for every "
        f"system, torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}; model "
        f"{model_name(c)}, {dtype_text(c)}; our in-process engine on {c.get('engine_malloc', 'glibc malloc')}. "
        f"Load average (1/5/15 min) at start "
        f"{m['loadavg_at_start']}, at end {m.get('loadavg_at_end')}; above {m['usable_cpus']} means other processes "
        f"competed for the CPU.",
        "",
        "| System | Mode | Requests | Output tokens | Tokens/s | Req/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
        "| E2E p50 / p99 (s) | Mean batch | Preemptions | KV stored/reserved (waste) | Load avg before/after |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rounds = _num_rounds(report["runs"])
    for r in report["runs"]:
        if r["system"] == "ceiling":
            lines.append(f"| {LABELS['ceiling']}, decode only | {r['mode']} | | | {r['output_tokens_per_s']:.1f} | | | "
                         f"{r['step_s'] * 1e3:.0f} / step | | {r['batch']} (ctx {r['context']}) | | | |")
            lines.append(f"| {LABELS['ceiling']}, with prefill | {r['mode']} | | {r['work']['output_tokens']} | "
                         f"{r['with_prefill_tokens_per_s']:.1f} | | | {r['prefill_s_per_token'] * 1e3:.2f} / prompt "
                         f"token | | | | | |")
            lines.append(f"| ours, decode step at the ceiling's batch and context | {r['mode']} | | | "
                         f"{r['engine_output_tokens_per_s']:.1f} | | | {r['engine_step_s'] * 1e3:.0f} / step | | "
                         f"{r['batch']} (ctx {r['context']}) | | | |")
            continue
        kv = r.get("kv")
        kv_text = f"{kv['stored_per_reserved']:.3f} ({kv['waste_pct']:.1f}%)" if kv else "n/a"
        ttft = _pair(r["ttft_s_p50"], r["ttft_s_p99"], "{:.2f}") + ("" if r["streams"] else " (=E2E)")
        label = LABELS[r["system"]] + (f" (round {r['round'] + 1})" if rounds > 1 else "")
        lines.append(
            f"| {label} | {r['mode']} | {r['requests']} | {r['output_tokens']} | "
            f"{r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.3f} | {ttft} | "
            f"{_pair(r['itl_ms_p50'], r['itl_ms_p99'], '{:.0f}')} | {_pair(r['e2e_s_p50'], r['e2e_s_p99'], '{:.2f}')} | "
            f"{_num(r['mean_batch'], '{:.1f}')} | {_num(r['preemptions'], '{}')} | {kv_text} | "
            f"{r['loadavg_before'][0]:.1f} / {r['loadavg_after'][0]:.1f} |")
    if report.get("limits"):
        from benchmarks.limits import markdown as limits_markdown

        lines += ["", limits_markdown(report["limits"], report["config"].get("quantization", "none"))]
    lines += ["", "Ratios of output tokens/s:", "", "| Mode | " + " | ".join(k for k, *_ in RATIOS) + " |",
              "|---|" + "---:|" * len(RATIOS)]
    for mode, ratios in report["ratios"].items():
        per_round = report.get("ratios_by_round", {}).get(mode, {})
        lines.append(f"| {mode} | " + " | ".join(_ratio(ratios[k], k) + _rounds_text(per_round.get(k), k)
                                                 for k, *_ in RATIOS) + " |")
    if rounds > 1:
        lines += ["", f"{rounds} rounds: each ratio is the median of the rounds' ratios (in brackets, round by round)."]
    lines += ["", *spread_table(report)]
    lines += ["", "Targets (offline runs; KV waste on every engine run):", "", "| Target | Wanted | Measured | Met |",
              "|---|---|---:|---|"]
    for t in report["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['name']} | {t['target']} | {_ratio(t['value'], t['name'])} | {met} |")
    checks = report["checks"]
    lines += ["", f"Token counts exact for every run: {'yes' if checks['all_tokens_exact'] else '**NO**'}."]
    lines += agreement_lines(checks)
    lines += ["", "Notes:", ""]
    notes: dict[tuple[str, str], list[str]] = {}  # (system, note) -> modes, so a note shared by modes shows once
    for r in report["runs"]:
        batch = [f"mean batch = {r['batch_source']}"] if r.get("batch_source") else []
        for note in [*r.get("notes", []), *batch]:
            notes.setdefault((r["system"], note), []).append(r["mode"])
    lines += [f"- {system} ({', '.join(modes)}): {note}" for (system, note), modes in notes.items()]
    for name, reason in report["skipped"].items():
        lines.append(f"- {name}: skipped: {reason}")
    lines += [f"- {k}: {v}" for k, v in report["definitions"].items()]
    if "prefix_cache" in report:
        from benchmarks.prefix_cache import markdown as prefix_markdown

        lines += prefix_markdown(report["prefix_cache"])
    return "\n".join(lines) + "\n"


def model_name(config: dict) -> str:
    if config.get("shape"):
        return f"shape {config['shape']} (random weights, benchmarks.shapes)"
    return config["model"] or "SmolLM2-135M-Instruct (default)"


def dtype_text(config: dict) -> str:
    """The run's dtype: ``auto`` with what it meant on the machine (bf16 with AVX512-BF16, AMX, or AVX2 without AVX-512; else fp32)."""
    dtype, resolved = config.get("dtype", "auto"), config.get("dtype_resolved")
    return f"auto ({resolved} here)" if dtype == "auto" and resolved else dtype


def page_markdown(report: dict) -> str:
    """The summary docs/performance.md shows of a run (``benchmarks.docs_page``): tokens/s by round with their
    spread, the ratios to the peers round by round, latencies where a mode has them, and the checks."""
    w, c = report["workload"], report["config"]
    malloc = f"; ours in process on {c['engine_malloc']}" if c.get("engine_malloc") else ""
    quantized = f" (ours: quantization {c['quantization']})" if c.get("quantization", "none") != "none" else ""
    lines = [f"Model {model_name(c)}, {dtype_text(c)}{quantized}, "
             f"{report['machine'].get('torch_threads')} threads; {w['num_requests']} requests "
             f"({w['total_output_tokens']} output tokens, `ignore_eos`){malloc}.", "", *spread_table(report)]
    if report.get("limits"):
        from benchmarks.limits import markdown as limits_markdown

        lines += ["", limits_markdown(report["limits"], report["config"].get("quantization", "none"))]
    for mode, ratios in report["ratios"].items():
        per_round = report.get("ratios_by_round", {}).get(mode, {})
        shown = [f"{key.replace('_vs_', ' / ')} **{_ratio(value, key)}**{_rounds_text(per_round.get(key), key)}"
                 for key, value in ratios.items() if value is not None and key in PAGE_RATIOS]
        if shown:
            lines += ["", f"Ratios of output tokens/s, {mode} (median of rounds; round by round in brackets): "
                          + "; ".join(shown) + "."]
    latency = [r for r in report["runs"] if r["system"] != "ceiling" and r["mode"] != "offline"]
    if latency:
        lines += ["", "| System | Mode | Round | Tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |",
                  "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {LABELS[r['system']]} | {r['mode']} | {r.get('round', 0) + 1} | {r['output_tokens_per_s']:.1f} | "
                  f"{_pair(r['ttft_s_p50'], r['ttft_s_p99'], '{:.2f}')} | "
                  f"{_pair(r['itl_ms_p50'], r['itl_ms_p99'], '{:.0f}')} |" for r in latency]
    checks = report["checks"]
    lines += ["", f"Every run produced exactly the workload's output lengths: "
                  f"{'yes' if checks['all_tokens_exact'] else '**no**'}."]
    lines += agreement_lines(checks)
    lines += [f"**{LABELS[system]} did not run as prescribed here**: {note}." for system, note in
              dict.fromkeys((r["system"], n) for r in report["runs"] for n in r.get("notes", []) if DEVIATION in n)]
    if second_pool(report["config"], report["runs"], report.get("limits")):
        lines += [SECOND_POOL_NOTE]
    return "\n".join(lines) + "\n"


# Runs written before the benchmark ran its probes, baselines and ceilings on threads of their own measured our
# in-process engine beside a second OpenMP pool (benchmarks.runner), which made it slower than it serves.
SECOND_POOL_NOTE = ("**Ours ran slower here than it serves**: this run's probes or baselines ran torch on the "
                    "benchmark's own thread before our engine's rounds, leaving a second OpenMP pool beside the "
                    "engine's, which puts every barrier of its steps to sleep; its ratios understate ours "
                    "([how much](#a-second-openmp-pool-in-older-runs)).")
_BESIDE_ENGINE = (*HF_BASELINES, "ceiling")  # in-process systems that ran torch on that thread


def second_pool(config: dict, runs: list[dict], limits: dict | None) -> bool:
    """Whether a report's in-process engine ran beside another OpenMP pool of the benchmark's own thread: written
    before ``parts_on_own_threads``, with the engine and something that ran torch on that thread (the machine
    probe of a round, the limits, a baseline or the ceiling)."""
    systems = {r["system"] for r in runs}
    return ("engine" in systems and not config.get("parts_on_own_threads")
            and (bool(limits) or any("machine_gflops_before" in r for r in runs)
                 or bool(systems & set(_BESIDE_ENGINE))))


def agreement_lines(checks: dict) -> list[str]:
    """Markdown lines: per peer and mode, how many requests got our engine's first 16 greedy tokens."""
    return [f"Same first 16 greedy tokens as {label} ({mode}): {agreement['same']} of {agreement['requests']} "
            f"requests." for peer, label in AGREEMENT_PEERS.items()
            for mode, agreement in checks.get(f"same_first_tokens_as_{peer}", {}).items()]


# The wording of a run's note that says a system ran without part of its prescribed setup (reports written before
# the benchmark refused to run vLLM without tcmalloc carry "... vLLM ran without it"): the page shows such notes.
DEVIATION = "ran without"
PAGE_RATIOS = ("engine_vs_vllm", "server_vs_vllm", "engine_vs_llamacpp", "server_vs_engine", "engine_vs_static",
               "engine_vs_naive")


def spread_table(report: dict) -> list[str]:
    """Markdown lines: each system's tokens/s round by round, median and spread (:func:`spread`), and, where the
    runs sampled it (:mod:`benchmarks.steadiness`), the machine's matmul rate before each round."""
    rounds = _num_rounds(report["runs"])
    entries = [(mode, system, entry) for mode, systems in report.get("spread", {}).items()
               for system, entry in systems.items()]
    # one probe per system and round (the round's modes share it): counted once
    probes = list({(r["system"], r.get("round", 0)): r["machine_gflops_before"] for r in report["runs"]
                   if r.get("machine_gflops_before")}.values())
    lines = ["| System | Mode | Tokens/s by round | Median | Spread (max - min) / median |"
             + (" Machine matmul GFLOP/s before each round (min-max) |" if probes else ""),
             "|---|---|---|---:|---:|" + ("---|" if probes else "")]
    for mode, system, entry in entries:
        spread_text = "n/a" if entry["spread_pct"] is None else f"{entry['spread_pct']:.0f}%"
        line = (f"| {LABELS[system]} | {mode} | {', '.join(f'{v:.1f}' for v in entry['tokens_per_s'])} | "
                f"{entry['median']:.1f} | {spread_text} |")
        if probes:
            before = entry.get("machine_gflops_before", [])
            line += " " + ", ".join(f"{p['min']:.0f}-{p['max']:.0f}" for p in before) + " |"
        lines.append(line)
    if probes:
        low, high = min(p["min"] for p in probes), max(p["max"] for p in probes)
        median = statistics.median(p["median"] for p in probes)
        lines += ["", f"The machine itself: a {probes[0]['n']}^3 {probes[0]['dtype']} matmul on the run's threads, "
                      f"sampled for {probes[0]['seconds']:g} s before each system's round, ran at {low:.0f}-{high:.0f} "
                      f"GFLOP/s (median of the rounds' medians {median:.0f}; spread {100 * (high - low) / median:.0f}%): "
                      f"a machine whose own rate moves this much may move any system's figures."]
    if rounds < MIN_ROUNDS_FOR_SPREAD:
        lines += ["", f"{rounds} round(s): the spread needs at least {MIN_ROUNDS_FOR_SPREAD} "
                      f"(`--rounds {MIN_ROUNDS_FOR_SPREAD}`); a single figure here may be off by the machine's "
                      f"run-to-run variation."]
    return lines


def _rounds_text(values: list[float] | None, key: str) -> str:
    return f" ({', '.join(_ratio(v, key) for v in values)})" if values and len(values) > 1 else ""


def _range(stats: dict) -> str:
    return f"{stats['min']}-{stats['max']} (mean {stats['mean']:g})"


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def _pair(a, b, fmt: str) -> str:
    return "n/a" if a is None else f"{fmt.format(a)} / {fmt.format(b)}"


def _ratio(value, key: str) -> str:
    if value is None:
        return "n/a"
    if "kv_waste" in key:
        return f"{value:.2f}%"
    percent = "ceiling" in key or key == "server_vs_engine"
    return f"{value:.0%}" if percent else f"{value:.2f}x"
