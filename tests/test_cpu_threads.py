"""Pinning the engine's torch threads: the CPU-list format, the auto policy, and a real pin of a thread."""

import os
import threading

import pytest

import kernels.cpu
from backend.config import EngineConfig
from backend.cpu_threads import ThreadBinder, parse_cpu_list, plan_binding

ALLOWED = sorted(os.sched_getaffinity(0))


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("5") == [5]
    for bad in ("", "a-b", "3-1", "1,1", "-2"):
        with pytest.raises(ValueError, match="cpu_threads_bind"):
            parse_cpu_list(bad)


def test_auto_pins_only_when_the_threads_use_every_allowed_cpu():
    assert plan_binding("auto", len(ALLOWED)) == ALLOWED
    if len(ALLOWED) > 1:
        assert plan_binding("auto", len(ALLOWED) - 1) is None  # other engines may share these cores
    assert plan_binding("off", len(ALLOWED)) is None
    assert plan_binding(str(ALLOWED[-1]), 1) == [ALLOWED[-1]]
    with pytest.raises(ValueError, match="outside"):
        plan_binding(str(max(ALLOWED) + 1), 1)


def test_engine_config_keeps_the_words_and_checks_lists():
    assert EngineConfig.from_dict({"cpu_threads_bind": "auto"}).cpu_threads_bind == "auto"
    assert EngineConfig.from_dict({"cpu_threads_bind": "0-1"}).cpu_threads_bind == "0-1"
    with pytest.raises(ValueError, match="cpu_threads_bind"):
        EngineConfig(cpu_threads_bind="zero")


@pytest.mark.skipif(kernels.cpu.load() is None, reason="no C++ compiler for kernels/cpu")
def test_bind_threads_pins_the_calling_thread_only():
    target = ALLOWED[-1]
    seen = {}

    def step() -> None:  # a team of one thread: the calling thread itself
        kernels.cpu.bind_threads([target])
        seen["affinity"] = os.sched_getaffinity(0)  # pid 0: the calling thread

    thread = threading.Thread(target=step)
    thread.start()
    thread.join()
    assert seen["affinity"] == {target}
    assert os.sched_getaffinity(0) == set(ALLOWED)  # the main thread is not touched


@pytest.mark.skipif(kernels.cpu.load() is None or len(ALLOWED) < 2, reason="needs the kernels and two CPUs")
def test_binder_pins_each_new_stepping_thread_even_with_an_ended_ones_id():
    """A loop thread started after another one ended (the engine stopped and started again) often gets the ended
    thread's id from the C library; it is pinned all the same."""
    import torch

    binder, seen = ThreadBinder([ALLOWED[-1]]), []

    def step() -> None:
        binder.ensure_bound()
        seen.append((threading.get_ident(), os.sched_getaffinity(0)))

    threads = torch.get_num_threads()
    try:
        for _ in range(3):
            thread = threading.Thread(target=step)
            thread.start()
            thread.join()
    finally:
        torch.set_num_threads(threads)
    assert [affinity for _, affinity in seen] == [{ALLOWED[-1]}] * 3


def test_binder_leaves_the_main_thread_unpinned():
    """Processes the main thread starts later (a test's tritonserver) would inherit its pinning."""
    ThreadBinder([ALLOWED[-1]]).ensure_bound()
    assert os.sched_getaffinity(0) == set(ALLOWED)


@pytest.mark.skipif(kernels.cpu.load() is None, reason="no C++ compiler for kernels/cpu")
def test_native_orphan_watchdog_ends_the_process_when_the_parent_is_not_the_one_given():
    """The Triton stub's GIL-free watchdog: a process whose parent is not the given pid ends with status 1; one
    whose parent is keeps running."""
    import subprocess
    import sys

    code = ("import os, sys, time, kernels.cpu; kernels.cpu.exit_when_orphaned(int(sys.argv[1]), 0.02); "
            "time.sleep(3); print('alive')")
    wrong = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "alive" not in wrong.stdout
    right = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True, text=True,
                           timeout=60)
    assert right.returncode == 0 and "alive" in right.stdout


# In a fresh interpreter (pytest's own thread may already own a pool): the threads a torch operation's OpenMP
# pool adds stay while the thread that made it lives, and go with a thread run by run_on_fresh_thread.
POOL_SCRIPT = """
import os, threading, time, torch
from backend.cpu_threads import run_on_fresh_thread
torch.set_num_threads(2)
count = lambda: len(os.listdir("/proc/self/task"))
work = lambda: float(torch.ones(1 << 22).sum())
before = count()
assert run_on_fresh_thread(work) == float(1 << 22)
deadline = time.monotonic() + 10
while count() != before and time.monotonic() < deadline:  # the pool's workers end just after their master
    time.sleep(0.05)
after_fresh = count()
try:
    run_on_fresh_thread(lambda: 1 / 0)
except ZeroDivisionError:
    raised = True
done, stay = threading.Event(), threading.Event()
def worker():
    work(); done.set(); stay.wait()
t = threading.Thread(target=worker); t.start(); done.wait()
alive = count() - 1  # less the worker thread itself
stay.set(); t.join()
print(before, after_fresh, alive, raised)
"""


@pytest.mark.skipif(len(ALLOWED) < 2, reason="an OpenMP pool needs two CPUs")
def test_loading_on_a_fresh_thread_leaves_no_openmp_pool_behind():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    before, after_fresh, alive, raised = out.stdout.split()
    assert int(after_fresh) == int(before)  # the fresh thread's pool went with it
    assert int(alive) > int(before)  # a live thread's pool keeps its worker
    assert raised == "True"  # errors reach the caller
