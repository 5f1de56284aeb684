"""Compiles structured-output constraints into grammars, once per distinct constraint (an LRU cache): each
first in a worker process with a deadline (``compile_worker``), killed when it passes it, then, once it has
compiled in time there, here."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from backend.background import BACKGROUND_NICE, lower_this_thread_priority
from backend.errors import EngineOverloadedError
from backend.structured_output.compile_worker import compile_constraint, read_frame, write_frame
from backend.structured_output.params import StructuredOutputsParams
from backend.structured_output.schema_check import SchemaLimits, check_json_schema, check_regex, with_ecma_dot

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (each holds per-state token masks: tens of KiB to MiB)
DEFAULT_COMPILE_TIMEOUT = 10.0  # CPU seconds one compile may use before its constraint is refused
DEFAULT_COMPILE_THREADS = 2  # compiles running at once, each in a process of its own
PROCESS_START_TIMEOUT_S = 60.0  # for a compile process to import xgrammar (seconds of CPU, once per process)
BUSY_WALL_FACTOR = 3.0  # a compile short of its CPU seconds after this many times them in wall time: a 503
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: ")  # "[13:41:12] /project/cpp/x.cc:94: " in xgrammar errors
WORKER_SCRIPT = Path(__file__).with_name("compile_worker.py")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # units of /proc/PID/stat's CPU times


class GrammarCompiler:
    """Turns :class:`StructuredOutputsParams` into an xgrammar ``CompiledGrammar`` for one tokenizer.

    Thread-safe; called on the thread that adds a request (never the engine loop), so the request is queued
    only once its grammar is ready, and an invalid constraint fails that request alone. A JSON schema is
    first checked (:func:`~backend.structured_output.schema_check.check_json_schema`: every keyword enforced,
    size, depth and keyword count bounded), a regex too (:func:`~backend.structured_output.schema_check.check_regex`).
    The compile first runs in one of ``compile_threads`` worker processes (``compile_worker``, each fed by a
    thread here) at a lower CPU priority (nice 5, ``backend/background.py``: the step's threads go first). Its
    deadline, ``compile_timeout``, is in CPU seconds of that process, so a constraint gets the same verdict on a
    busy machine as on an idle one: a compile that uses them all is refused, its process is killed (xgrammar's
    compile cannot be interrupted; the next compile starts a new process), and the refusal is cached like a
    grammar, so the same constraint is refused at once next time. One that compiled in time there is compiled
    again on the feeding thread (nice 5 too; xgrammar releases the GIL), which then takes about as long: a
    compiled grammar's JSON can be a hundred times the size and ten times the compile time to pass between
    processes (``compile_worker``). The caller waits at most :data:`BUSY_WALL_FACTOR` times ``compile_timeout``
    in wall time (then a 503).

    The tokenizer's vocabulary is read on first use (about 1 s for a 49k-token BPE vocabulary), so engines
    whose requests never ask for structured outputs pay nothing.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        cache_size: compiled grammars (and refusals) kept, least recently used dropped first.
        schema_limits: bounds on a JSON schema.
        compile_timeout: CPU seconds a compile may use.
        compile_threads: compiles that may run at once (worker processes, started on first use).

    Attributes:
        num_compiled, num_cache_hits: counters, for tests and stats.
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE,
                 schema_limits: SchemaLimits = SchemaLimits(), compile_timeout: float = DEFAULT_COMPILE_TIMEOUT,
                 compile_threads: int = DEFAULT_COMPILE_THREADS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.schema_limits = schema_limits
        self.compile_timeout = compile_timeout
        self.compile_threads = compile_threads
        self._lock = threading.Lock()
        self._tokenizer_info = None  # xgrammar.TokenizerInfo and its JSON, on first use
        self._info_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()  # a grammar or a _Refused
        self._pending: dict[tuple[str, str], _Job] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._processes: dict[int, _CompileProcess] = {}  # by worker thread (its ident), while it has one
        self._ready_since = float("inf")  # time.monotonic() when the first compile process was ready
        self.num_compiled = 0
        self.num_cache_hits = 0

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        """Whether :meth:`compile` would answer ``params`` from the cache (a grammar or a refusal) without
        checking or compiling: a caller that must not wait (Triton's execute thread) compiles the rest
        elsewhere."""
        with self._lock:
            return (params.kind, params.spec) in self._cache

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar for ``params`` (cached by kind and text).

        Raises:
            ValueError: the schema, regex or grammar is invalid, unsupported (xgrammar's reason, without its
                source location), uses a keyword the grammar would not enforce, exceeds a bound, or used
                ``compile_timeout`` CPU seconds compiling.
            EngineOverloadedError: every compile thread was busy for ``compile_timeout`` seconds, or the
                compile had too little CPU to finish or use its seconds in :data:`BUSY_WALL_FACTOR` times that
                (the constraint itself may be fine: try again later).
        """
        key = (params.kind, params.spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
        if cached is not None:
            return _unwrap(cached)
        try:
            _check(params, self.schema_limits)
        except ValueError as exc:
            refused = _Refused(f"invalid structured_outputs.{params.kind}: {exc}")
            self._store(key, refused)
            return _unwrap(refused)
        with self._lock:
            job = self._pending.get(key)
            if job is None:
                self._get_tokenizer_info()
                job = self._pending[key] = _Job(key, params)
                self._start_workers()
                self._jobs.put(job)
        return self._await(job)

    def _await(self, job: "_Job"):
        """Waits for ``job``: its grammar, or a refusal once it has used ``compile_timeout`` CPU seconds, or
        :class:`EngineOverloadedError` when it stayed queued that long or has run :data:`BUSY_WALL_FACTOR`
        times that long in wall time without using its CPU seconds (a busy machine: compiles run at a
        lower priority). Waits sleep until the earliest moment either could hold: a compile cannot use CPU
        faster than the clock runs."""
        waited_from = time.monotonic()
        wall_limit = self.compile_timeout * BUSY_WALL_FACTOR
        while True:
            waited = time.monotonic() - waited_from
            if not job.future.running() and not job.future.done():  # still queued
                if self._ready_since == float("inf"):  # no compile process ready yet (they start at the first)
                    budget = min(PROCESS_START_TIMEOUT_S - waited, 0.5)
                else:  # the queue's clock starts once one is
                    budget = self.compile_timeout - (time.monotonic() - max(waited_from, self._ready_since))
                if budget <= 0 and job.future.cancel():
                    with self._lock:
                        self._pending.pop(job.key, None)
                    raise EngineOverloadedError(f"the grammar compiler was busy for {self.compile_timeout:g} s "
                                                f"(compile_timeout); try again later")
            elif not job.future.done():
                used = job.cpu_seconds()
                if used >= self.compile_timeout:
                    refused = self._too_slow(job)
                    job.stop()  # its process is killed: the compile slot and the core are free again
                    return _unwrap(refused)
                # Wall time counts from when its child began to compile: a compile process that is starting
                # (importing xgrammar: seconds, once) is given PROCESS_START_TIMEOUT_S.
                compiling = time.monotonic() - max(waited_from, job.compiling_since)
                if compiling >= wall_limit:  # not cached: the compile goes on and its grammar is kept when done
                    raise EngineOverloadedError(
                        f"the grammar compile had {used:.1f} s of CPU time in {compiling:.0f} s (the machine is "
                        f"busy; compile_timeout is {self.compile_timeout:g} s of CPU time); try again later")
                if job.compiling_since == float("inf") and waited >= PROCESS_START_TIMEOUT_S:
                    raise EngineOverloadedError(f"the grammar compile process did not start in "
                                                f"{PROCESS_START_TIMEOUT_S:g} s (the machine is busy); try again later")
                budget = min(self.compile_timeout - used, wall_limit - compiling, 0.5)
            else:
                budget = 0
            try:
                return job.future.result(timeout=max(budget, 0.01))
            except FutureTimeout:
                pass

    def _run(self, job: "_Job", process: "_CompileProcess | None") -> "_CompileProcess | None":
        """On a worker thread: compiles one job in ``process`` (a new one when it is None or has died) and
        stores its grammar or refusal (unless already refused). Returns the process for the next job (None when
        it was killed or died)."""
        job.started = time.monotonic()
        if not job.future.set_running_or_notify_cancel():
            return process
        try:
            if process is not None and not process.alive():
                process.close()
                process = None
            if process is None:
                process = self._start_process()
            # The kernel's limit ends a compile that nobody waits for any more (after a 503) at the deadline too.
            limit = max(1, math.ceil(self.compile_timeout))
            reply = process.compile(*_xgrammar_call(job.params), limit, on_start=job.attach)
            job.detach(float(reply[1:] or 0) if reply is not None and reply[:1] == b"G" else 0.0)
            if reply is None:  # the worker process died (killed, or out of memory): not the constraint's fault
                code, process = process.close(), None
                raise EngineOverloadedError(f"the grammar compile process exited (code {code}); try again later")
            if reply[:1] == b"K":
                status = int(reply[1:])
                if job.stopped or (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU):
                    refused = self._too_slow(job)
                    job.future.set_exception(ValueError(refused.message))
                    return process
                raise EngineOverloadedError(f"the grammar compile ended without a result (wait status {status}); "
                                            f"try again later")
            kind, payload = reply[:1], reply[1:].decode(errors="replace")
            if kind == b"G" and (job.stopped or job.cpu_used >= self.compile_timeout):
                # Its child used the deadline's CPU seconds (the kernel's limit is whole seconds), or a waiter
                # refused it meanwhile: refused, and never compiled here.
                job.future.set_exception(ValueError(self._too_slow(job).message))
            elif kind == b"G":  # it compiles in time: compiled here again (the same call, deterministic)
                try:
                    compiled = compile_constraint(self._local_compiler(), *_xgrammar_call(job.params))
                except (RuntimeError, ValueError, TypeError) as exc:  # compiled in the child: not cached
                    raise RuntimeError(f"the grammar compile failed: {_NATIVE_PREFIX.sub('', str(exc))[:500]}") \
                        from exc
                self._store(job.key, compiled, from_compile=True)
                job.future.set_result(compiled)
            elif kind == b"I":
                text = payload.strip()
                message = _NATIVE_PREFIX.sub("", text).splitlines()[0][:500] if text else "invalid"
                refused = _Refused(f"invalid structured_outputs.{job.params.kind}: {message}")
                self._store(job.key, refused, from_compile=True)
                job.future.set_exception(ValueError(refused.message))
            else:  # not the constraint's fault (e.g. out of memory): not cached
                raise RuntimeError(f"the grammar compile failed: {payload[:500]}")
        except Exception as exc:
            job.future.set_exception(exc)
        finally:
            with self._lock:
                self._pending.pop(job.key, None)
        return process

    def _too_slow(self, job: "_Job") -> "_Refused":
        """Refuses ``job``'s constraint for using its CPU seconds, and remembers it (stays refused)."""
        refused = _Refused(f"invalid structured_outputs.{job.params.kind}: compiling it took over "
                           f"{self.compile_timeout:g} s of CPU time (compile_timeout); simplify it")
        self._store(job.key, refused)
        return refused

    def _store(self, key: tuple[str, str], value: object, from_compile: bool = False) -> None:
        with self._lock:
            if from_compile and isinstance(self._cache.get(key), _Refused):
                return  # refused for running past its deadline: stays refused
            if from_compile and not isinstance(value, _Refused):
                self.num_compiled += 1
            self._cache[key] = value
            self._cache.move_to_end(key)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _start_workers(self) -> None:
        """Starts the compile threads on first use (daemons: never holds up exit); each starts its process on its
        first job. Called under ``_lock``."""
        while len(self._workers) < self.compile_threads:
            worker = threading.Thread(target=self._work, args=(self._jobs,),
                                      name=f"grammar-compile-{len(self._workers)}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def _work(self, jobs: queue.SimpleQueue) -> None:
        """A worker thread: starts its process at once (every worker's at the first compile, together: importing
        xgrammar takes seconds), then compiles the jobs it takes, at the background priority."""
        lower_this_thread_priority()
        try:
            process = self._start_process()
        except Exception:  # started again, and reported, with the first job
            log.exception("starting a grammar compile process failed")
            process = None
        while (job := jobs.get()) is not None:
            process = self._run(job, process)
            if process is None:
                self._processes.pop(threading.get_ident(), None)
        self._processes.pop(threading.get_ident(), None)
        if process is not None:
            process.close()

    def _start_process(self) -> "_CompileProcess":
        """Starts the calling worker thread's compile process. Raises what ``_CompileProcess`` raises."""
        process = self._processes[threading.get_ident()] = _CompileProcess(self._get_tokenizer_info()[1])
        with self._lock:
            self._ready_since = min(self._ready_since, time.monotonic())
        return process

    def close(self) -> None:
        """Stops the compile threads and kills their processes; a later compile starts new ones. Compiles in
        progress in a worker process fail (their callers get an error; one already compiling in this process, its
        second compile, finishes), queued ones are answered 503 after ``compile_timeout``."""
        with self._lock:
            jobs, self._jobs = self._jobs, queue.SimpleQueue()
            workers, self._workers = self._workers, []
            processes = list(self._processes.values())
            self._ready_since = float("inf")
        for _ in workers:
            jobs.put(None)
        for process in processes:
            process.kill()

    def worker_pids(self) -> list[int]:
        """The process ids of the compile processes running now (for tests and tools)."""
        return [process.pid for process in list(self._processes.values()) if process.alive()]

    def _local_compiler(self):
        """A new ``xgrammar.GrammarCompiler`` in this process for the tokenizer (microseconds; one per compile,
        so the worker threads share none; its own cache is off: this class caches)."""
        import xgrammar

        return xgrammar.GrammarCompiler(self._get_tokenizer_info()[0], max_threads=1, cache_enabled=False)

    def _get_tokenizer_info(self):
        """The tokenizer's ``xgrammar.TokenizerInfo`` and its JSON (what a compile process starts from)."""
        with self._info_lock:
            if self._tokenizer_info is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._tokenizer_info = (info, info.serialize_json().encode())
            return self._tokenizer_info


class _CompileProcess:
    """The parent's end of one ``compile_worker`` process: started with the tokenizer's vocabulary, then
    compiles one constraint at a time, each in a child it forks.

    Raises (from the constructor):
        RuntimeError: the process did not start or did not get ready.
    """

    def __init__(self, info_json: bytes) -> None:
        python = _python()
        flags = ["-P"] if sys.version_info >= (3, 11) else []  # not this directory on sys.path: stdlib names win
        self.process = subprocess.Popen([python, *flags, str(WORKER_SCRIPT), str(BACKGROUND_NICE)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.pid = self.process.pid
        try:
            write_frame(self.process.stdin, info_json)
            ready = read_frame(self.process.stdout)
        except OSError:
            ready = None
        if ready != b"R":
            self.close()
            raise RuntimeError(f"the grammar compile process ({python} {WORKER_SCRIPT.name}) did not start "
                               f"(exit code {self.exit_code()}; its error is in the server's log)")

    def compile(self, method: str, argument: str, cpu_seconds: int, on_start) -> bytes | None:
        """The reply to one compile (status byte + payload, see ``compile_worker``), or None when the worker
        process is gone. ``on_start(pid)`` is called with the process id of the child that compiles, which the
        kernel ends after ``cpu_seconds`` of CPU time."""
        try:
            write_frame(self.process.stdin, json.dumps([method, argument, cpu_seconds]).encode())
            started = read_frame(self.process.stdout)
            if started is None or started[:1] != b"P":
                return None
            on_start(int(started[1:]))
            return read_frame(self.process.stdout)
        except (OSError, ValueError):  # a closed pipe: the process is gone
            return None

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_code(self) -> int | None:
        return self.process.poll()

    def kill(self) -> None:
        try:
            self.process.kill()
        except OSError:
            pass

    def close(self) -> int | None:
        """Ends the process (its input closed, killed if it does not exit at once), reaps it and returns its
        exit code."""
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _python() -> str:
    """The interpreter for compile processes: this one, or, where this process is not a Python executable
    (Triton's backend stub embeds the interpreter), the ``python3`` of this environment's prefix."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    candidate = Path(sys.prefix) / "bin" / "python3"
    return str(candidate) if candidate.exists() else "python3"


class _Job:
    """One compile in flight: callers asking for the same constraint wait on the same future."""

    def __init__(self, key: tuple[str, str], params: StructuredOutputsParams) -> None:
        self.key = key
        self.params = params
        self.future: Future = Future()
        self.started = float("inf")  # time.monotonic() when a worker took it
        self.compiling_since = float("inf")  # time.monotonic() when its child began to compile
        self.stopped = False  # killed at its deadline
        self.cpu_used = 0.0  # CPU seconds its child used, once it replied
        self._pid: int | None = None  # the process compiling it, while it does
        self._lock = threading.Lock()  # no kill once the reply is in (the process id may be reused after)

    def attach(self, pid: int) -> None:
        with self._lock:
            self._pid = pid
            self.compiling_since = time.monotonic()
            if self.stopped:
                _kill(pid)

    def detach(self, cpu_used: float = 0.0) -> None:
        """The child has replied, having used ``cpu_used`` CPU seconds (what :meth:`cpu_seconds` says from now)."""
        with self._lock:
            self.cpu_used = cpu_used
            self._pid = None

    def stop(self) -> None:
        """Kills the process compiling this job, if it still is."""
        with self._lock:
            self.stopped = True
            if self._pid is not None:
                _kill(self._pid)

    def cpu_seconds(self) -> float:
        """CPU seconds the compile has used so far (wall seconds where its process's cannot be read)."""
        pid = self._pid
        if pid is None:  # its process is starting (0), or its child is done (what it used)
            return self.cpu_used
        used = _process_cpu_seconds(pid)
        return max(0.0, time.monotonic() - self.started) if used is None else used


def _process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used (user + system), from /proc; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime and stime, fields 14 and 15


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


class _Refused:
    """A cached refusal: the same constraint is refused again without being checked or compiled."""

    def __init__(self, message: str) -> None:
        self.message = message


def _unwrap(cached: object):
    if isinstance(cached, _Refused):
        raise ValueError(cached.message)
    return cached


def _check(params: StructuredOutputsParams, limits: SchemaLimits) -> None:
    """Refuses, before compiling, a schema keyword or regex construct the grammar would not enforce."""
    if params.kind == "json":
        check_json_schema(params.json, limits)
    elif params.kind == "regex":
        check_regex(params.regex)


def _xgrammar_call(params: StructuredOutputsParams) -> tuple[str, str]:
    """The worker's compile method and its argument for ``params`` (see ``compile_worker``)."""
    kind = params.kind
    if kind == "json":  # already parsed and checked by _check
        return "json_schema", params.json
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "regex":
        return "regex", with_ecma_dot(params.regex)
    if kind == "choice":  # a grammar of string literals (JSON string escapes are EBNF's too)
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
    return "grammar", params.grammar
