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
