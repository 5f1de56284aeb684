"""The memory allocator of the engine's process: tcmalloc where it is installed, else glibc's malloc.

glibc hands large blocks back to the kernel when they are freed, so every step's large activations (prefill's
especially) are page-faulted and zeroed again by the kernel; tcmalloc keeps them for the next step. vLLM's CPU
installation docs preload the same library (Debian/Ubuntu package ``libtcmalloc-minimal4``), and Triton's docs
suggest tcmalloc or jemalloc for tritonserver. The launcher preloads it into tritonserver, whose Python backend
stub, the engine's process, inherits it (``--malloc``); ``python -m benchmarks`` preloads it into its own
process, where the engine runs in process, so that it measures the engine as served
(docs/performance.md gives the difference).
"""

from __future__ import annotations

import glob

TCMALLOC_GLOB = "/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4"
CHOICES = ("auto", "tcmalloc", "system")  # auto: tcmalloc where installed


def tcmalloc_path(pattern: str = TCMALLOC_GLOB) -> str | None:
    """The installed tcmalloc library, or None."""
    found = sorted(glob.glob(pattern))
    return found[0] if found else None


def preload(env: dict[str, str], choice: str = "auto", pattern: str = TCMALLOC_GLOB) -> tuple[dict[str, str], str]:
    """``env`` for a process whose allocator is ``choice``, and which allocator that is, in words (for the log).

    Raises:
        FileNotFoundError: ``choice`` is ``tcmalloc`` and it is not installed.
        ValueError: ``choice`` is not one of :data:`CHOICES`.
    """
    if choice not in CHOICES:
        raise ValueError(f"malloc must be one of {', '.join(CHOICES)}, got {choice!r}")
    path = None if choice == "system" else tcmalloc_path(pattern)
    if path is None:
        if choice == "tcmalloc":
            raise FileNotFoundError("tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")
        return env, "glibc malloc" + ("" if choice == "system" else " (tcmalloc not installed: apt-get install "
                                                                      "libtcmalloc-minimal4)")
    preloads = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if path not in preloads:
        env = {**env, "LD_PRELOAD": ":".join([path, *preloads])}
    return env, f"tcmalloc ({path})"


def without(env: dict[str, str], path: str | None) -> dict[str, str]:
    """``env`` with ``path`` taken out of ``LD_PRELOAD`` (for a peer that must run with its own allocator)."""
    preloads = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != path]
    env = {k: v for k, v in env.items() if k != "LD_PRELOAD"}
    if preloads:
        env["LD_PRELOAD"] = ":".join(preloads)
    return env
