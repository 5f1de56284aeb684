"""Compiles structured-output constraints into grammars, once per distinct constraint (an LRU cache), each
compile on a worker thread with a deadline."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from backend.background import lower_this_thread_priority
from backend.errors import EngineOverloadedError
from backend.structured_output.params import StructuredOutputsParams
from backend.structured_output.schema_check import SchemaLimits, check_json_schema, check_regex

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (each holds per-state token masks: tens of KiB to MiB)
DEFAULT_COMPILE_TIMEOUT = 10.0  # CPU seconds one compile may use before its constraint is refused
DEFAULT_COMPILE_THREADS = 2  # compiles running at once (a compile past its deadline keeps its thread)
BUSY_WALL_FACTOR = 3.0  # a compile short of its CPU seconds after this many times them in wall time: a 503
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: ")  # "[13:41:12] /project/cpp/x.cc:94: " in xgrammar errors


class GrammarCompiler:
    """Turns :class:`StructuredOutputsParams` into an xgrammar ``CompiledGrammar`` for one tokenizer.

    Thread-safe; called on the thread that adds a request (never the engine loop), so the request is queued
    only once its grammar is ready, and an invalid constraint fails that request alone. A JSON schema is
    first checked (:func:`~backend.structured_output.schema_check.check_json_schema`: every keyword enforced,
    size, depth and keyword count bounded), a regex too (:func:`~backend.structured_output.schema_check.check_regex`).
    The compile itself runs on one of ``compile_threads`` worker threads at a lower CPU priority (nice
    5, ``backend/background.py``: xgrammar releases the GIL, and the step's threads go first). Its deadline,
    ``compile_timeout``, is in CPU seconds of that thread, so a constraint gets the same verdict on a busy machine
    as on an idle one: a compile that uses them all is refused and remembered as refused (its result, when it
    comes, is dropped), so the same constraint is refused at once next time. Refusals are cached like grammars.
    The caller waits at most :data:`BUSY_WALL_FACTOR` times ``compile_timeout`` in wall time (then a 503).

    The tokenizer's vocabulary is read on first use (about 1 s for a 49k-token BPE vocabulary), so engines
    whose requests never ask for structured outputs pay nothing.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        cache_size: compiled grammars (and refusals) kept, least recently used dropped first.
        schema_limits: bounds on a JSON schema.
        compile_timeout: CPU seconds a compile may use.
        compile_threads: compiles that may run at once.

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
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()  # a grammar or a _Refused
        self._pending: dict[tuple[str, str], _Job] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
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
                compiler = self._get_compiler()
                job = self._pending[key] = _Job(key, params)
                self._start_workers()
                self._jobs.put((job, compiler))
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
                budget = self.compile_timeout - waited
                if budget <= 0 and job.future.cancel():
                    with self._lock:
                        self._pending.pop(job.key, None)
                    raise EngineOverloadedError(f"the grammar compiler was busy for {self.compile_timeout:g} s "
                                                f"(compile_timeout); try again later")
            elif not job.future.done():
                used = job.cpu_seconds()
                if used >= self.compile_timeout:
                    refused = _Refused(f"invalid structured_outputs.{job.params.kind}: compiling it took over "
                                       f"{self.compile_timeout:g} s of CPU time (compile_timeout); simplify it")
                    self._store(job.key, refused)  # the compile's own result, when it comes, is dropped
                    return _unwrap(refused)
                if waited >= wall_limit:  # not cached: the compile goes on and its grammar is kept when done
                    raise EngineOverloadedError(
                        f"the grammar compile had {used:.1f} s of CPU time in {waited:.0f} s (the machine is "
                        f"busy; compile_timeout is {self.compile_timeout:g} s of CPU time); try again later")
                budget = min(self.compile_timeout - used, wall_limit - waited)
            else:
                budget = 0
            try:
                return job.future.result(timeout=max(budget, 0.01))
            except FutureTimeout:
                pass

    def _run(self, job: "_Job", compiler) -> None:
        """On a worker thread: compiles one job and stores its grammar or refusal (unless already refused)."""
        job.cpu_clock, job.cpu_start = self._thread_cpu_clock()
        job.started = time.monotonic()
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            compiled = _compile(compiler, job.params)
        except (RuntimeError, ValueError, TypeError) as exc:
            text = str(exc).strip()
            message = _NATIVE_PREFIX.sub("", text).splitlines()[0][:500] if text else type(exc).__name__
            refused = _Refused(f"invalid structured_outputs.{job.params.kind}: {message}")
            self._store(job.key, refused, from_compile=True)
            job.future.set_exception(ValueError(refused.message))
        except Exception as exc:  # not the constraint's fault (e.g. out of memory): not cached
            job.future.set_exception(exc)
        else:
            self._store(job.key, compiled, from_compile=True)
            job.future.set_result(compiled)
        finally:
            with self._lock:
                self._pending.pop(job.key, None)

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
        """Starts the compile threads on first use (daemons: a compile past its deadline never holds up exit)."""
        while len(self._workers) < self.compile_threads:
            worker = threading.Thread(target=self._work, name=f"grammar-compile-{len(self._workers)}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def _work(self) -> None:
        lower_this_thread_priority()  # the step goes first (backend/background.py)
        while True:
            job, compiler = self._jobs.get()
            self._run(job, compiler)

    @staticmethod
    def _thread_cpu_clock() -> tuple[int | None, float]:
        """The calling thread's CPU-time clock and its reading (None and 0 where the platform has none)."""
        try:
            clock = time.pthread_getcpuclockid(threading.get_ident())
            return clock, time.clock_gettime(clock)
        except (AttributeError, OSError):
            return None, 0.0

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            # Its own cache is off: ours bounds the count and counts hits.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


class _Job:
    """One compile in flight: callers asking for the same constraint wait on the same future."""

    def __init__(self, key: tuple[str, str], params: StructuredOutputsParams) -> None:
        self.key = key
        self.params = params
        self.future: Future = Future()
        self.started = float("inf")  # time.monotonic() when a worker took it
        self.cpu_clock: int | None = None  # the worker's CPU-time clock (time.pthread_getcpuclockid)
        self.cpu_start = 0.0

    def cpu_seconds(self) -> float:
        """CPU seconds the compile has used so far (wall seconds where the platform has no thread clock)."""
        if self.cpu_clock is None:
            return max(0.0, time.monotonic() - self.started)
        return time.clock_gettime(self.cpu_clock) - self.cpu_start


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


def _compile(compiler, params: StructuredOutputsParams):
    kind = params.kind
    if kind == "json":  # already parsed and checked by _check
        # Compact separators and no free whitespace: a small model sampling at temperature 1 could otherwise
        # spend its whole budget on newlines between the tokens of a valid document.
        return compiler.compile_json_schema(params.json, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":  # a grammar of string literals (JSON string escapes are EBNF's too)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                   for c in params.choice))
    return compiler.compile_grammar(params.grammar)
