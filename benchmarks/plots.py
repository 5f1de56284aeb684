"""PNG figures from a report: throughput per system, latency CDFs, our engine's batch and KV use over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import LABELS  # noqa: E402


def write_plots(report: dict, out_dir: Path) -> list[Path]:
    runs = report["runs"]
    if not runs:  # e.g. only prefix_cache was run, or every system failed: the report says so
        return []
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    paths = [_throughput(runs, modes, out_dir / "throughput.png"), _latency_cdfs(runs, modes, out_dir / "latency_cdf.png")]
    engine_runs = [r for r in runs if r.get("timeline")]
    if engine_runs:
        paths.append(_engine_timeline(engine_runs, out_dir / "engine_timeline.png"))
    return paths


def _throughput(runs: list[dict], modes: list[str], path: Path) -> Path:
    systems = list(dict.fromkeys(r["system"] for r in runs))
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, mode in enumerate(modes):
        values = {r["system"]: r["output_tokens_per_s"] for r in runs if r["mode"] == mode}
        xs = np.arange(len(systems)) + i * width
        bars = ax.bar(xs, [values.get(s, 0) for s in systems], width, label=mode)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(np.arange(len(systems)) + width * (len(modes) - 1) / 2)
    ax.set_xticklabels([LABELS[s] for s in systems], rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("useful output tokens/s")
    ax.set_title("Throughput per system (same model, dtype and threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _latency_cdfs(runs: list[dict], modes: list[str], path: Path) -> Path:
    metrics = (("ttft_s", "TTFT (s)"), ("e2e_s", "end-to-end latency (s)"))
    fig, axes = plt.subplots(len(modes), len(metrics), figsize=(11, 3.8 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        for col, (key, label) in enumerate(metrics):
            ax = axes[row][col]
            for r in runs:
                if r["mode"] == mode and r.get("latencies"):
                    values = np.sort(r["latencies"][key])
                    ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=LABELS[r["system"]])
            ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{mode}: {label}")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _engine_timeline(engine_runs: list[dict], path: Path) -> Path:
    fig, axes = plt.subplots(len(engine_runs), 1, figsize=(10, 3.5 * len(engine_runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], engine_runs):
        tl = run["timeline"]
        ax.plot(tl["t_s"], tl["step_requests"], label="requests in step", color="tab:blue")
        ax.set_xlabel("time since run start (s)")
        ax.set_ylabel("requests")
        twin = ax.twinx()
        twin.plot(tl["t_s"], tl["kv_used_pct"], label="KV blocks used %", color="tab:orange")
        twin.plot(tl["t_s"], tl["kv_waste_pct"], label="KV waste % (of reserved)", color="tab:red", alpha=0.6)
        twin.set_ylabel("%")
        twin.set_ylim(0, 100)
        ax.set_title(f"our engine, in process, {run['mode']}: running batch and KV use")
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
