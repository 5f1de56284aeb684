"""Pinning the engine's torch threads to CPU cores (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``).

On a CPU every operation of a step ends in an OpenMP barrier: a step is as fast as its slowest thread. A
thread the OS migrates, or parks on a core another of the team's threads uses, stalls the whole team, and
with other processes running this happens at most steps. vLLM's CPU docs have users pin; the engine does it by default when it owns the
machine's CPUs.

One OpenMP team per process: GNU OpenMP (the runtime torch's CPU wheels ship) keeps a pool of worker threads
for every thread that ever started a parallel region, and once the pools hold more threads than the process
has CPUs it stops spinning at barriers ("throttled" waiting: about 1,000 spins instead of 300,000, whatever
``GOMP_SPINCOUNT`` says), so every operation of a step ends with its threads asleep in the kernel and woken
again. Loading the model on the caller's thread and stepping on the loop thread would make two pools, and
every step many times the context switches of one. :func:`run_on_fresh_thread` runs the loading on a thread that exits
afterwards (its pool goes with it), so the thread that steps owns the only pool.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

log = logging.getLogger(__name__)


def run_on_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread that ends when it returns: OpenMP pools its parallel regions create end with
    it (see the module docstring). Exceptions are raised in the caller."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=body, name="llm-engine-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-3,8"`` -> ``[0, 1, 2, 3, 8]`` (the Linux cpulist format).

    Raises:
        ValueError: not a CPU list.
    """
    cpus: list[int] = []
    try:
        for part in spec.split(","):
            first, _, last = part.strip().partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ValueError(f"cpu_threads_bind must be auto, off or a CPU list like 0-3,8; got {spec!r}") from None
    if not cpus or min(cpus) < 0 or len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_threads_bind must list distinct CPU ids; got {spec!r}")
    return cpus


def plan_binding(setting: str, num_threads: int) -> list[int] | None:
    """The CPU of each torch thread, or None for no pinning.

    ``auto`` pins thread ``i`` to the ``i``-th CPU this process may run on when the threads use all of them
    (the engine owns the machine or its cgroup); with fewer threads than CPUs it does not pin, since other
    engine processes (another model version, another instance) would be pinned onto the same cores. ``off``
    never pins; a CPU list pins to those CPUs and sets the thread count to their number.

    Raises:
        ValueError: a malformed list, or CPUs this process may not use.
    """
    if setting == "off":
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if setting == "auto":
        return allowed if num_threads == len(allowed) else None
    cpus = parse_cpu_list(setting)
    if not set(cpus) <= set(allowed):
        raise ValueError(f"cpu_threads_bind {setting!r} names CPUs outside this process's {allowed}")
    return cpus


class ThreadBinder:
    """Pins, once per calling thread, the torch threads that thread's forward passes run on.

    OpenMP keeps one thread team per thread that starts parallel regions, so the pinning happens on the thread
    that steps the engine, the first time it steps: the loop thread of ``LLMEngine.start`` (how the Triton model
    and the benchmarks run it). The main thread is left unpinned: processes it starts later (a test's
    tritonserver) would inherit its pinning.
    """

    def __init__(self, cpus: list[int] | None) -> None:
        self.cpus = cpus
        # Per thread object, not per thread id: the C library gives an ended thread's id to the next one started
        # (a loop thread started after another was stopped), which must be pinned too.
        self._local = threading.local()

    def ensure_bound(self) -> None:
        if self.cpus is None or getattr(self._local, "bound", False):
            return
        if threading.current_thread() is threading.main_thread():
            return
        from backend import cpu_ops

        self._local.bound = True
        try:
            if torch.get_num_threads() != len(self.cpus):
                torch.set_num_threads(len(self.cpus))
            cpu_ops.bind_threads(self.cpus)
            log.info("torch threads pinned to CPUs %s", self.cpus)
        except RuntimeError as exc:  # no compiler, or a container that forbids it: run unpinned
            log.warning("torch threads not pinned: %s", exc)
