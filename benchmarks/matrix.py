"""``python -m benchmarks.matrix``: ours against the peers at every model shape, offline and at 1, 4 and 16 streams,
in one command, with the goals printed as ratios.

For each shape (:data:`benchmarks.shapes.SHAPES`, random weights) and dtype the matrix runs ``python -m benchmarks``
once per cell: ``offline`` (every request at t=0), then ``concurrent`` at each stream count (a closed loop of that
many requests in flight), each cell with the same systems in alternating rounds (``--rounds``), the physical limits
measured beside it (memory read rate and GEMM peak: :mod:`benchmarks.limits`). Each cell is its own process, as a
user would run it (the in-process engine on the served allocator, a fresh vLLM and llama.cpp). The cells' reports
stay in ``OUTPUT_DIR/<shape>-<dtype>-<cell>/`` (``--resume`` keeps a cell's report that the cell's own command
wrote on this machine with every system running, and runs the other cells); the matrix report, ``OUTPUT_DIR/report.json``, keeps each cell's
summary (tokens/s and latencies by round, ratios, limits, checks; not the per-request lists) and the goals, and
``report.md`` shows them. ``--publish NAME`` keeps it as ``docs/results/NAME.json`` and regenerates
docs/performance.md (``benchmarks.docs_page``), where ``<!-- result: NAME -->`` shows it.

The goals (each a ratio, per shape; "at equal weight bits": llama.cpp on a GGUF of the same dtype, or its
``--llamacpp-quant`` weights beside ours ``--quantization``):

- offline output tokens/s, ours / vLLM, at least 1.5;
- ITL p50 at one stream, ours / vLLM, at most 0.7, and ours / llama.cpp, at most 1.0;
- ITL p50 at one stream over the physical floor (every weight read once per step at the measured read rate), at
  most 1.3;
- one row through every weight matrix of a decode step, our kernel's time over llama.cpp's, at most 1.0: with
  llama.cpp among the systems and equal weight formats (no ``--quantization`` or ``--llamacpp-quant``), each shape and
  dtype also runs :mod:`benchmarks.ggml_gemv` (:data:`KERNEL_ROUNDS` rounds alternating in one window, its result in
  ``OUTPUT_DIR/<shape>-<dtype>-kernel/result.json``). The cells' systems run minutes apart, and on a shared host
  the memory bandwidth moves by half in that time: the one-stream ITL against llama.cpp then says which window each
  system drew, and this one says which reads the weights faster;
- output tokens/s at 16 streams, ours / llama.cpp, at least 1.3 (the int8 goal, shown at every weight format).

Each ratio is the median of the rounds' own ratios (each between runs minutes apart, as the benchmark's own ratios;
the kernel's within a second).
A cell that fails, runs past ``--cell-timeout`` seconds (it is killed with the peers it started), or where no system
ran, is named in the report and the others still run; the matrix then exits 1 and does not publish.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import DEVIATION, LABELS, SECOND_POOL_NOTE, second_pool, write_json

log = logging.getLogger("benchmarks.matrix")

DEFAULT_SHAPES = ("smollm2-360m", "smollm2-1.7b", "llama-3b")
DEFAULT_STREAMS = (1, 4, 16)
DEFAULT_SYSTEMS = ("engine", "vllm", "llamacpp")
OFFLINE_REQUESTS = 12  # the quick workload's; a concurrent cell runs max(12, 2 x streams) so the loop stays full
RUN_KEYS = ("system", "mode", "round", "requests", "output_tokens", "expected_tokens", "duration_s",
            "output_tokens_per_s", "ttft_s_p50", "ttft_s_mean", "ttft_s_p99", "itl_ms_p50", "itl_ms_p99", "mean_batch",
            "machine_gflops_before", "notes")
CELL_OPTIONS = {"--shape", "--dtype", "--systems", "--modes", "--concurrency", "--quick", "--num-requests", "--rounds",
                "--limits", "--no-progress", "--output-dir"}
DEFAULT_CELL_TIMEOUT_S = 7200
KERNEL_ROUNDS = 20
KERNEL_DTYPES = ("bfloat16", "float32")  # the weight types benchmarks.ggml_gemv gives both kernels
KERNEL_OPTIONS = ("--threads", "--model")  # the options of a cell's that benchmarks.ggml_gemv takes too
REPORT_KEYS = ("config", "workload", "skipped", "ratios", "ratios_by_round", "spread", "limits", "checks", "command",
               "date", "wall_s")


@dataclass(frozen=True)
class Cell:
    """One benchmark run of the matrix: a shape and dtype, offline (``streams`` None) or ``streams`` in flight."""

    shape: str
    dtype: str
    streams: int | None = None

    @property
    def name(self) -> str:
        return f"{self.shape}-{self.dtype}-" + ("offline" if self.streams is None else f"c{self.streams}")

    def args(self, systems: tuple[str, ...], rounds: int, extra: list[str]) -> list[str]:
        """``python -m benchmarks`` arguments of this cell (``extra``: passed on, e.g. ``--quantization w8a8``)."""
        requests = OFFLINE_REQUESTS if self.streams is None else max(OFFLINE_REQUESTS, 2 * self.streams)
        mode = ["--modes", "offline"] if self.streams is None else ["--modes", "concurrent",
                                                                   "--concurrency", str(self.streams)]
        shape = [] if self.shape == "default" else ["--shape", self.shape]
        return [*shape, "--dtype", self.dtype, "--systems", ",".join(systems), *mode, "--quick",
                "--num-requests", str(requests), "--rounds", str(rounds), "--limits", "--no-progress", *extra]


def plan(shapes: tuple[str, ...], dtypes: tuple[str, ...], streams: tuple[int, ...]) -> list[Cell]:
    """The cells in the order they run: per shape and dtype, offline then each stream count."""
    return [Cell(shape, dtype, s) for shape in shapes for dtype in dtypes for s in (None, *streams)]


def kernel_args(shape: str, dtype: str, extra: list[str]) -> list[str] | None:
    """``python -m benchmarks.ggml_gemv`` arguments for a shape and dtype, or None where it does not apply: a dtype
    it does not take, or weights other than the dtype's (``--quantization``, ``--llamacpp-quant`` in ``extra``)."""
    given = _options(extra)
    if dtype not in KERNEL_DTYPES or given.get("--quantization", "none") != "none" or given.get("--llamacpp-quant"):
        return None
    passed = [part for name in KERNEL_OPTIONS if name in given for part in (name, given[name])]
    source = [] if "--model" in given else ["--shape", shape]  # default: the default model
    return [*source, "--dtype", dtype, "--rounds", str(KERNEL_ROUNDS), *passed]


def _options(extra: list[str]) -> dict[str, str]:
    """``--name value`` and ``--name=value`` pairs of ``extra`` (a flag, followed by another option, maps to "")."""
    given, i = {}, 0
    while i < len(extra):
        name, eq, value = extra[i].partition("=")
        if name.startswith("--") and not eq and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            value, i = extra[i + 1], i + 1
        given[name] = value
        i += 1
    return given


MACHINE_KEYS = ("cpu_model", "cpu_features", "l3_cache", "usable_cpus", "memory_gib")  # what --resume compares


def same_machine(kept: dict | None) -> bool:
    """Whether a kept report's ``machine`` (:func:`benchmarks.machine.machine_info`) is this machine: its CPU model,
    features, L3, usable CPUs and memory. Figures from another machine do not go into one matrix."""
    from benchmarks.machine import machine_info

    here = machine_info(1)
    return bool(kept) and all(kept.get(key) == here[key] for key in MACHINE_KEYS)


def _run_process(command: list[str], timeout_s: float | None) -> int:
    """Runs ``command`` (its output to this process's standard error, its standard output dropped) as the leader of
    a process group of its own; its exit status. Past ``timeout_s`` seconds it and every process it started (a llama-server, vLLM's
    workers) are killed.

    Raises:
        RuntimeError: it ran past ``timeout_s``.
    """
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise RuntimeError(f"`{' '.join(command[1:])}` ran past {timeout_s:.0f} s and was killed (--cell-timeout)")
    except BaseException:  # interrupted: take its children down with it
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


def _run_kept(module: str, args: list[str], output: list[str], path: Path, resume: bool, timeout_s: float | None,
              usable=lambda kept: True) -> dict:
    """Runs ``python -m MODULE ARGS OUTPUT`` in a process of its own (:func:`_run_process`); the JSON it wrote at
    ``path``. With ``resume``, one already there that this very command wrote on this machine, and that ``usable``
    accepts, is returned instead.

    Raises:
        RuntimeError: the run failed (its exit status; its output went to this process's standard error) or ran
            past ``timeout_s`` seconds (it and the processes it started are killed).
    """
    command = [sys.executable, "-m", module, *args, *output]
    if resume and path.exists():
        try:
            kept = json.loads(path.read_text())
        except ValueError:  # cut short: run it again
            kept = {}
        if (kept.get("command") == " ".join([f"python -m {module}", *command[3:]]) and usable(kept)
                and same_machine(kept.get("machine"))):
            log.info("kept %s (--resume)", path)
            return kept
    log.info("running %s", " ".join(command[1:]))
    status = _run_process(command, timeout_s)
    if status != 0:
        raise RuntimeError(f"`python -m {module} {' '.join(args)}` exited with {status}")
    return json.loads(path.read_text())


def run_kernel(args: list[str], output_dir: Path, resume: bool = False, timeout_s: float | None = None) -> dict:
    """``python -m benchmarks.ggml_gemv ARGS --output OUTPUT_DIR/result.json`` (:func:`_run_kept`); its result."""
    path = output_dir / "result.json"
    return _run_kept("benchmarks.ggml_gemv", args, ["--output", str(path)], path, resume, timeout_s)


def condense_kernel(result: dict) -> dict:
    """The kernel comparison's figures the matrix keeps: each round's times, rates and ratio, and the medians."""
    keep = ("dtype", "threads", "matrices", "weight_bytes", "llamacpp", "gap_s", "huge_page_bytes", "rounds", "median",
            "median_ratio_by_first", "command", "date")
    return {key: result[key] for key in keep if key in result}


def run_cell(args: list[str], output_dir: Path, resume: bool = False, timeout_s: float | None = None) -> dict:
    """``python -m benchmarks ARGS --output-dir OUTPUT_DIR`` (:func:`_run_kept`; a kept report only where every
    system ran); its report."""
    return _run_kept("benchmarks", args, ["--output-dir", str(output_dir)], output_dir / "report.json", resume,
                     timeout_s, usable=lambda kept: not kept.get("skipped"))


def condense(report: dict) -> dict:
    """A cell's report without the per-request lists, the timelines and the written files' paths."""
    out = {key: report[key] for key in REPORT_KEYS if key in report}
    out["runs"] = [{key: run.get(key) for key in RUN_KEYS} for run in report["runs"]]
    return out


def _median_ratio(runs: list[dict], field: str, system: str, peer: str) -> tuple[float | None, list[float]]:
    """Median over the rounds of ``system``'s ``field`` over ``peer``'s in the same round, and the rounds' ratios."""
    values = {(r["system"], r.get("round", 0)): r.get(field) for r in runs}
    ratios = [values[system, i] / values[peer, i] for (name, i) in values
              if name == system and values.get((peer, i)) and values[system, i] is not None]
    return (statistics.median(ratios) if ratios else None), ratios


def goals(cells: dict[Cell, dict], kernel: dict | None = None) -> list[dict]:
    """The goals of one shape and dtype from its cells' condensed reports and its kernel comparison (``kernel``,
    :func:`condense_kernel`'s): name, value (a ratio), the rounds' values, the target and whether it is met (value
    and met None where a system, cell or the kernel comparison is missing)."""
    by_streams = {cell.streams: report for cell, report in cells.items()}
    offline, one, sixteen = (by_streams.get(s, {"runs": []}) for s in (None, 1, 16))
    floor = (one.get("limits") or {}).get("itl_floor_ms")
    ours = [r["itl_ms_p50"] for r in one["runs"] if r["system"] == "engine" and r["itl_ms_p50"] is not None]
    over_floor = [v / floor for v in ours] if floor else []
    measured = [  # name, target, met, (value, rounds)
        ("offline tokens/s, ours / vLLM", ">= 1.5x", lambda v: v >= 1.5,
         _median_ratio(offline["runs"], "output_tokens_per_s", "engine", "vllm")),
        ("ITL p50 at 1 stream, ours / vLLM", "<= 0.7x", lambda v: v <= 0.7,
         _median_ratio(one["runs"], "itl_ms_p50", "engine", "vllm")),
        ("ITL p50 at 1 stream, ours / llama.cpp", "<= 1.0x", lambda v: v <= 1.0,
         _median_ratio(one["runs"], "itl_ms_p50", "engine", "llamacpp")),
        ("ITL p50 at 1 stream, ours / physical floor", "<= 1.3x", lambda v: v <= 1.3,
         (statistics.median(over_floor) if over_floor else None, over_floor)),
        ("tokens/s at 16 streams, ours / llama.cpp", ">= 1.3x", lambda v: v >= 1.3,
         _median_ratio(sixteen["runs"], "output_tokens_per_s", "engine", "llamacpp")),
        ("one row through every weight, kernel time, ours / llama.cpp", "<= 1.0x", lambda v: v <= 1.0,
         (kernel["median"]["ours_vs_llamacpp_time"], [r["ours_vs_llamacpp_time"] for r in kernel["rounds"]])
         if kernel else (None, [])),
    ]
    return [{"name": name, "target": target, "value": value, "rounds": rounds,
             "met": None if value is None else met(value)} for name, target, met, (value, rounds) in measured]


def build_matrix(results: list[tuple[Cell, dict]], command: str | None, failed: dict[str, str],
                 kernels: dict[tuple[str, str], dict] | None = None) -> dict:
    """The matrix report from the cells' full reports (in run order) and the kernel comparisons' results by (shape,
    dtype); ``failed``: cell name -> why it has none."""
    kernels = {key: condense_kernel(result) for key, result in (kernels or {}).items()}
    groups: dict[tuple[str, str], dict[Cell, dict]] = {}
    for cell, report in results:
        groups.setdefault((cell.shape, cell.dtype), {})[cell] = condense(report)
    machine = dict(results[0][1]["machine"]) if results else {}
    if results:
        machine["loadavg_at_end"] = results[-1][1]["machine"].get("loadavg_at_end")
    return {"benchmark": "benchmarks.matrix", "machine": machine, "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "failed": failed,
            "groups": [{"shape": shape, "dtype": dtype,
                        "cells": [{"name": c.name, "streams": c.streams, **r} for c, r in cells.items()],
                        "kernel": kernels.get((shape, dtype)),
                        "goals": goals(cells, kernels.get((shape, dtype)))} for (shape, dtype), cells in groups.items()]}


def page_markdown(report: dict) -> str:
    """Per shape and dtype: each system's tokens/s and latencies per cell (medians of the rounds, the spread
    beside), the physical limits, and the goals with their values round by round."""
    lines = []
    for group in report["groups"]:
        cells = group["cells"]
        config = cells[0]["config"]
        quant = config.get("quantization", "none")
        weights = group["dtype"] + (f", ours {quant}" if quant != "none" else "") + (
            f", llama.cpp {config['llamacpp_quant']}" if config.get("llamacpp_quant") else "")
        rounds = 1 + max((r.get("round") or 0 for c in cells for r in c["runs"]), default=0)
        mean = any(r.get("ttft_s_mean") is not None for c in cells for r in c["runs"])  # older reports lack it
        lines += [f"**{group['shape']}** ({weights}; {rounds} round{'s' if rounds > 1 else ''} per cell, alternating "
                  f"systems; medians, spread (max - min) / median in brackets):", "",
                  *_table_head(mean)]
        for cell in cells:
            label = "offline" if cell["streams"] is None else f"{cell['streams']} stream{'s' * (cell['streams'] > 1)}"
            for system in dict.fromkeys(r["system"] for r in cell["runs"]):
                runs = [r for r in cell["runs"] if r["system"] == system]
                lines.append(f"| {LABELS.get(system, system)} | {label} | {runs[0]['requests']} | "
                             f"{_median_text(runs, 'output_tokens_per_s', '{:.1f}')} | "
                             f"{_median_text(runs, 'ttft_s_p50', '{:.2f}')} | "
                             + (f"{_median_text(runs, 'ttft_s_mean', '{:.2f}')} | " if mean else "")
                             + f"{_median_text(runs, 'itl_ms_p50', '{:.0f}')} |")
            for system, why in cell.get("skipped", {}).items():
                lines.append(f"| {LABELS.get(system, system)} | {label} | | skipped: {why.replace('|', '/')} | | |"
                             + (" |" if mean else ""))
        if any(second_pool(c["config"], c["runs"], c.get("limits")) for c in cells):
            lines += ["", SECOND_POOL_NOTE]
        # the limits the floor goal divides by: the one-stream cell's, else the first measured
        limits = next((c["limits"] for c in sorted(cells, key=lambda c: c["streams"] != 1) if c.get("limits")), None)
        if limits:
            from benchmarks.limits import markdown as limits_markdown

            lines += ["", limits_markdown(limits, quant)]
        kernel = group.get("kernel")
        if kernel:
            m = kernel["median"]
            lines += ["", f"One row through every weight matrix ({kernel['matrices']} matrices, "
                          f"{kernel['weight_bytes'] / 1e9:.2f} GB), {len(kernel['rounds'])} rounds alternating in one "
                          f"window (`python -m benchmarks.ggml_gemv`; medians): ours {m['ours_ms']:.1f} ms "
                          f"({m['ours_gbps']:.1f} GB/s), llama.cpp's kernel {m['llamacpp_ms']:.1f} ms "
                          f"({m['llamacpp_gbps']:.1f} GB/s), the read-rate probe {m['probe_gbps']:.1f} GB/s."]
        lines += ["", "| Goal | Target | Value | Rounds | Met |", "|---|---|---:|---|---|"]
        for goal in group["goals"]:
            met = "n/a" if goal["met"] is None else ("yes" if goal["met"] else "**no**")
            value = "n/a" if goal["value"] is None else f"{goal['value']:.2f}x"
            lines.append(f"| {goal['name']} | {goal['target']} | {value} | "
                         f"{', '.join(f'{v:.2f}' for v in goal['rounds'])} | {met} |")
        exact = all(c["checks"]["all_tokens_exact"] for c in cells)
        lines += ["", f"Every run produced exactly the workload's output lengths: {'yes' if exact else '**no**'}."]
        lines += [f"**{LABELS.get(system, system)} did not run as prescribed here**: {note}." for system, note in
                  dict.fromkeys((r["system"], n) for c in cells for r in c["runs"] for n in r.get("notes") or []
                                if DEVIATION in n)]
        lines.append("")
    for name, why in report.get("failed", {}).items():
        lines.append(f"Cell {name} has no figures: {why}.")
    return "\n".join(lines).rstrip() + "\n"


def _table_head(mean: bool) -> list[str]:
    """The header rows of a group's table, with a TTFT mean column or without."""
    if mean:
        return ["| System | Cell | Requests | Tokens/s | TTFT p50 (s) | TTFT mean (s) | ITL p50 (ms) |",
                "|---|---|---:|---:|---:|---:|---:|"]
    return ["| System | Cell | Requests | Tokens/s | TTFT p50 (s) | ITL p50 (ms) |", "|---|---|---:|---:|---:|---:|"]


def _median_text(runs: list[dict], field: str, fmt: str) -> str:
    values = [r[field] for r in runs if r.get(field) is not None]
    if not values:
        return "n/a"
    median = statistics.median(values)
    if len(values) < 3 or not median:
        return fmt.format(median)
    return f"{fmt.format(median)} ({100 * (max(values) - min(values)) / median:.0f}%)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.matrix", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help="comma-separated shapes (benchmarks.shapes), or `default` for the default model")
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated dtypes (default bfloat16)")
    parser.add_argument("--streams", default=",".join(map(str, DEFAULT_STREAMS)),
                        help="comma-separated requests in flight, one concurrent cell each (default 1,4,16)")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="default engine,vllm,llamacpp")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell (default 3)")
    parser.add_argument("--output-dir", default="results/matrix")
    parser.add_argument("--cell-timeout", type=float, default=DEFAULT_CELL_TIMEOUT_S, metavar="SECONDS",
                        help=f"kill a cell (and the peers it started) past this many seconds and go on to the next "
                             f"(default {DEFAULT_CELL_TIMEOUT_S}; one round of a 3B cell took under 8 minutes on 2 cores)")
    parser.add_argument("--resume", action="store_true",
                        help="keep a cell's report already in the output directory if the same command wrote it on "
                             "this machine")
    parser.add_argument("--publish", metavar="NAME",
                        help="keep the report as docs/results/NAME.json and regenerate docs/performance.md")
    args, extra = parser.parse_known_args(argv)
    # the benchmark's parser takes any unambiguous prefix of an option: --conc would set --concurrency
    taken = sorted({a.split("=")[0] for a in extra if a.startswith("--")
                    and any(o.startswith(a.split("=")[0]) for o in CELL_OPTIONS)})
    if taken:
        parser.error(f"{', '.join(taken)}: the matrix sets {', '.join(sorted(CELL_OPTIONS))} per cell")
    from benchmarks.__main__ import build_parser
    from benchmarks.__main__ import parse_args as benchmark_args

    known = build_parser()._option_string_actions  # full names only: --stream would become --stream-interval
    inexact = [a.split("=")[0] for a in extra if a.startswith("--") and a.split("=")[0] not in known]
    if inexact:
        parser.error(f"{', '.join(inexact)}: not an option of the matrix or of `python -m benchmarks` (spell "
                     f"options in full)")
    from benchmarks.docs_page import RESULT_NAME

    if args.publish is not None and not RESULT_NAME.fullmatch(args.publish):
        parser.error(f"--publish takes lowercase letters, digits and dashes, got {args.publish!r}")
    from benchmarks.shapes import SHAPES

    args.shapes = tuple(s.strip() for s in args.shapes.split(",") if s.strip())
    unknown = [s for s in args.shapes if s != "default" and s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; known: default, {', '.join(SHAPES)}")
    if any(a.split("=")[0] == "--model" for a in extra) and args.shapes != ("default",):
        parser.error("--model replaces the default model: use it with --shapes default")
    args.dtypes = tuple(dict.fromkeys(d.strip() for d in args.dtypes.split(",") if d.strip()))
    try:
        args.streams = tuple(dict.fromkeys(int(s) for s in args.streams.split(",") if s.strip()))
    except ValueError:
        parser.error(f"--streams takes comma-separated integers, got {args.streams!r}")
    if not args.streams or min(args.streams) < 1:
        parser.error("--streams needs at least one count, each >= 1")
    if not args.shapes or not args.dtypes:
        parser.error("--shapes and --dtypes need at least one name each")
    args.systems = tuple(dict.fromkeys(s.strip() for s in args.systems.split(",") if s.strip()))
    if "engine" not in args.systems:
        parser.error("--systems must include engine (every goal is ours over a peer)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if not args.cell_timeout > 0:
        parser.error("--cell-timeout must be > 0")
    for dtype in args.dtypes:  # what the benchmark would refuse fails here, not in every cell
        benchmark_args(["--systems", ",".join(args.systems), "--dtype", dtype, *extra])
    args.extra = extra  # passed to every cell: --quantization, --llamacpp-quant, --threads, --model, ...
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    out = Path(args.output_dir)
    results, failed, kernels = [], {}, {}
    cells = plan(args.shapes, args.dtypes, args.streams)
    for cell in cells:
        try:
            report = run_cell(cell.args(args.systems, args.rounds, args.extra), out / cell.name, args.resume,
                              args.cell_timeout)
        except RuntimeError as exc:  # the other cells still run; the report names the one that failed
            log.error("%s: %s", cell.name, exc)
            failed[cell.name] = str(exc)
            continue
        if not report["runs"]:  # every system skipped: the benchmark says why and exits 0
            failed[cell.name] = "no system ran (" + "; ".join(f"{k}: {v}" for k, v in report["skipped"].items()) + ")"
            log.error("%s: %s", cell.name, failed[cell.name])
            continue
        results.append((cell, report))
    for shape, dtype in dict.fromkeys((c.shape, c.dtype) for c in cells):
        kernel = kernel_args(shape, dtype, args.extra) if "llamacpp" in args.systems else None
        if kernel is None:
            continue
        name = f"{shape}-{dtype}-kernel"
        try:
            kernels[shape, dtype] = run_kernel(kernel, out / name, args.resume, args.cell_timeout)
        except RuntimeError as exc:
            log.error("%s: %s", name, exc)
            failed[name] = str(exc)
    given = sys.argv[1:] if argv is None else argv
    report = build_matrix(results, " ".join(["python -m benchmarks.matrix", *given]), failed, kernels)
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / "report.json")
    (out / "report.md").write_text(page_markdown(report))
    print(page_markdown(report))
    if args.publish and failed:
        print(f"not published: {len(failed)} cell(s) failed (rerun with --resume to run only those)")
    elif args.publish:
        from benchmarks import docs_page

        if f"<!-- result: {args.publish} -->" not in docs_page.TEMPLATE.read_text():
            print(f"{docs_page.TEMPLATE.name} has no line `<!-- result: {args.publish} -->`: the page will not "
                  f"show it (and the docs test fails) until one is added")
        docs_page.keep(args.publish, out / "report.json", docs_page.RESULTS)
        docs_page.PAGE.write_text(docs_page.generate(None, docs_page.RESULTS))
        print(f"kept as docs/results/{args.publish}.json; docs/performance.md regenerated")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
