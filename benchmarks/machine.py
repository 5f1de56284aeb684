"""The machine a run was measured on: CPU, cores, memory, library versions, load from other processes."""

from __future__ import annotations

import os
import platform

import torch
import transformers


def machine_info(threads: int) -> dict:
    return {"cpu_model": _cpu_model(), "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
            "torch_threads": threads, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "loadavg_at_start": load_average()}


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: above the core count means other processes competed for the CPU."""
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
