"""The machine a run was measured on: CPU, its instruction-set features and cache, cores, memory, library
versions, load from other processes. A figure holds only with its machine: the same CPU model name covers
parts with and without AMX, and a cloud VM's last-level cache and memory bandwidth depend on its host."""

from __future__ import annotations

import os
import platform


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    return {"cpu_model": _cpu_model(), "cpu_features": cpu_features(), "l3_cache": _l3_cache(),
            "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1),
            "torch_threads": threads, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "loadavg_at_start": load_average()}


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages: above the core count means other processes competed for the CPU."""
    return [round(x, 2) for x in os.getloadavg()]


# The instruction-set features the kernels and torch choose their paths by (``/proc/cpuinfo`` flag names).
FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
            "amx_bf16", "amx_int8")


def cpu_features() -> list[str]:
    """Which of :data:`FEATURES` this CPU reports, in that order (empty where ``/proc/cpuinfo`` is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [name for name in FEATURES if name in flags]
    except OSError:
        pass
    return []


def features_text(machine: dict) -> str:
    """``AVX512-BF16, AVX512-VNNI, no AMX``-style summary of a report's ``cpu_features``."""
    features = machine.get("cpu_features")
    if features is None:
        return "CPU features not recorded"
    shown = [f.upper().replace("_", "-") for f in features if f.startswith(("avx512_", "amx_", "avx_vnni"))]
    if not any(f.startswith("amx") for f in features):
        shown.append("no AMX")
    if "avx512f" not in features:
        shown.append("no AVX-512")
    return ", ".join(shown)


def _l3_cache() -> str | None:
    """The last-level cache as the kernel reports it for CPU 0 (e.g. ``32768K``), None where unknown."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
