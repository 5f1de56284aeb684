"""Heavy work beside the step runs at a lower CPU priority, and a grammar compile is judged by the CPU time it
used, so a busy machine makes it wait (a 503), never refuses a constraint as too slow; one past its deadline is
killed (``backend/background.py``, ``backend/structured_output/compiler.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from backend.background import BACKGROUND_NICE, lower_this_thread_priority, this_thread_nice
from backend.errors import EngineOverloadedError
from backend.structured_output import StructuredOutputsParams
from backend.structured_output.compiler import BUSY_WALL_FACTOR, GrammarCompiler

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice and affinity: Linux")

# Dozens of patterned strings: seconds of compile on one core.
SLOW_SCHEMA = {"type": "object", "required": [f"p{i}" for i in range(40)],
               "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,20}(-[a-z]{1,20}){0,5}$"}
                              for i in range(40)}}


def test_a_lowered_thread_runs_at_the_background_nice_and_leaves_its_caller_alone():
    before = this_thread_nice()
    seen = {}

    def body():
        seen["set"] = lower_this_thread_priority()
        seen["nice"] = this_thread_nice()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == {"set": True, "nice": BACKGROUND_NICE}
    assert this_thread_nice() == before


@pytest.fixture()
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, vocab_size=len(tokenizer), compile_timeout=0.5, compile_threads=1)
    compiler.compile(StructuredOutputsParams(choice=["x"]))  # starts the worker and reads the vocabulary
    return compiler


def test_grammar_compiles_run_at_the_background_nice(compiler):
    (worker,) = compiler.worker_pids()
    assert os.getpriority(os.PRIO_PROCESS, worker) == BACKGROUND_NICE


def test_a_starved_compile_is_a_503_then_judged_by_its_cpu_time_once_it_gets_the_cpu(compiler):
    """Three busy processes on the compile process's only core leave it about 10% of it (weights 335 against
    3 x 1024), 0.15 CPU seconds in 1.5 s: past BUSY_WALL_FACTOR times compile_timeout the caller gets a 503 (not
    cached: the compile goes on); once the core is free the compile, which nobody waits for any more, reaches
    the CPU limit the kernel enforces and the constraint is refused as too slow from then on."""
    (worker,) = compiler.worker_pids()
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(worker, {cpu})  # the children it forks to compile inherit it
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 preexec_fn=lambda: os.sched_setaffinity(0, {cpu})) for _ in range(3)]
    params = StructuredOutputsParams(json=SLOW_SCHEMA)
    try:
        time.sleep(0.2)  # the spinners are running
        start = time.monotonic()
        with pytest.raises(EngineOverloadedError, match=r"the machine is busy"):
            compiler.compile(params)
        waited = time.monotonic() - start
        assert BUSY_WALL_FACTOR * 0.5 <= waited < BUSY_WALL_FACTOR * 0.5 + 1.0
        assert not compiler.is_cached(params)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    # Nobody waits for it now: the kernel ends it at its CPU limit (1 s: compile_timeout rounded up), and the
    # constraint is refused from then on.
    deadline = time.monotonic() + 60
    while not compiler.is_cached(params):
        assert time.monotonic() < deadline, "the compile was never ended at its CPU limit"
        time.sleep(0.1)
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"compiling it took over 0.5 s of CPU time"):
        compiler.compile(params)
    assert time.monotonic() - start < 0.5
    (worker,) = compiler.worker_pids()
    assert not [child for child in psutil.Process(worker).children() if child.status() != psutil.STATUS_ZOMBIE]


def test_a_compile_past_its_deadline_is_killed_and_the_next_one_runs_at_once(compiler):
    """xgrammar's compile cannot be interrupted: it runs in a child of the compile process, killed at the
    deadline, so the one compile slot and the core are free for the next constraint at once (the slow schema
    alone takes seconds of CPU)."""
    (worker,) = compiler.worker_pids()
    with pytest.raises(ValueError, match=r"compiling it took over 0.5 s of CPU time"):
        compiler.compile(StructuredOutputsParams(json=SLOW_SCHEMA))
    start = time.monotonic()
    compiler.compile(StructuredOutputsParams(json={"type": "integer"}))
    assert time.monotonic() - start < 2.0
    assert compiler.worker_pids() == [worker]  # the same process: only the compile's child was killed
    # The killed child is gone; the last compile's exits after its reply and is reaped at the next compile.
    deadline = time.monotonic() + 5
    while True:
        children = psutil.Process(worker).children()
        if len(children) <= 1 and all(child.status() == psutil.STATUS_ZOMBIE for child in children):
            break
        assert time.monotonic() < deadline, children
        time.sleep(0.05)
    with pytest.raises(ValueError, match=r"compiling it took over 0.5 s of CPU time"):
        compiler.compile(StructuredOutputsParams(json=SLOW_SCHEMA))  # refused at once from the cache


def test_a_compile_that_fails_in_this_process_after_its_worker_compiled_it_is_an_error_not_cached(
        compiler, monkeypatch):
    """The worker process compiles the constraint in time; the second compile, here, fails (say, out of memory):
    the caller gets the error, nothing is cached, and the same constraint compiles once this process can."""
    import backend.structured_output.compiler as compiler_module

    real = compiler_module.compile_constraint

    def failing(*args):
        raise RuntimeError("[10:00:00] /project/cpp/x.cc:1: out of memory")

    params = StructuredOutputsParams(regex="[a-c]{3}")
    monkeypatch.setattr(compiler_module, "compile_constraint", failing)
    with pytest.raises(RuntimeError, match=r"^the grammar compile failed: out of memory$"):
        compiler.compile(params)
    assert not compiler.is_cached(params)
    monkeypatch.setattr(compiler_module, "compile_constraint", real)
    assert compiler.compile(params) is not None and compiler.is_cached(params)
