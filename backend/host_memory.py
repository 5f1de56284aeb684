"""How much memory this process can still take on the CPU: what the KV cache is sized from when no size is given.

``MemAvailable`` of ``/proc/meminfo`` is Linux's estimate of memory that new allocations can get without swapping
(free memory plus page cache and reclaimable slabs that can be dropped); free memory alone leaves out the page
cache, which a machine that has read model weights is full of. In a container, ``/proc/meminfo`` still describes
the whole host, so the cgroup's own limit less its usage (cgroup v2 ``memory.max`` / ``memory.current``, or v1
``memory.limit_in_bytes`` / ``memory.usage_in_bytes``) caps it: a pod is killed at its limit, not at the host's.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

CGROUP_FILES = (("memory.max", "memory.current"),  # cgroup v2
                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))  # cgroup v1


def available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Bytes of memory this process can still allocate: the host's ``MemAvailable`` (free pages where Linux
    does not report it), capped by the cgroup's limit less its usage where the process has a limit."""
    available = _meminfo_available(meminfo)
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, usage_file in CGROUP_FILES:
        limit, usage = _read_int(Path(cgroup) / limit_file), _read_int(Path(cgroup) / usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes "no limit" as ~2^63
            return max(0, min(available, limit - usage))
    return available


def _meminfo_available(path: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())  # "max" (cgroup v2: no limit) is not an int
    except (OSError, ValueError):
        return None


def total_bytes() -> int | None:
    """The host's physical memory in bytes (None where the OS does not say): no allocation can be larger."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


JEMALLOC_ALL_ARENAS = 4096  # jemalloc's MALLCTL_ARENAS_ALL: "arena.4096.purge" purges every arena


def release_free_memory() -> str | None:
    """Hands the memory this process's C allocator holds freed back to the OS; which allocator's call ran
    (``"tcmalloc"``, ``"jemalloc"``, ``"glibc"``), or None where none exists (musl, macOS) or the process's symbols
    cannot be read.

    Loading a model allocates and frees gigabytes (the checkpoint's own tensors, replaced by packed copies). tcmalloc,
    which the launcher preloads (``serve/allocator.py``), keeps freed spans for reuse and returns them to the OS only
    slowly: the 1.7B shape in fp32 stayed at 18.0 GB resident with 11.8 GB in use (glibc's malloc: 11.8), memory no
    other process on the machine could get. ``MallocExtension_ReleaseFreeMemory`` (tcmalloc) and ``malloc_trim(0)``
    (glibc: every arena's free pages, not only the heap's top) return it, and jemalloc's ``arena.<all>.purge``
    (which Triton's docs suggest preloading as well; it would otherwise return freed pages over its decay time, 10 s
    by default, and without a background thread only as it allocates again); memory in use is untouched. glibc's
    call runs besides a preloaded allocator's: it costs little and frees nothing that is in use.
    """
    try:
        process = ctypes.CDLL(None)  # the symbols the process has loaded, a preloaded allocator's first
    except OSError:
        return None
    ran = None
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
        ran = "tcmalloc"
    mallctl = getattr(process, "mallctl", None)
    if mallctl is not None:
        mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        if mallctl(f"arena.{JEMALLOC_ALL_ARENAS}.purge".encode(), None, None, None, 0) == 0:
            ran = ran or "jemalloc"
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)
        ran = ran or "glibc"
    return ran
