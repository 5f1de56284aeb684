"""The engine's public face: ``add_request`` / ``abort`` / ``stats`` from any thread, and the step loop.

``step()`` reads top to bottom: the engine core takes new requests and aborts -> ``Scheduler.schedule()``
-> ``ModelRunner.execute()`` -> ``Scheduler.update_from_output()`` (``backend.engine_core``); then the
output processor detokenizes, finds stop strings (handed back to the scheduler), fans ``n`` > 1 back in and
puts the deltas on the callers' sinks (``backend.output_processor``). A background thread calls ``step()``
while there is work (continuous batching, Orca, Yu et al. OSDI 2022); it never calls out of the engine
except to put deltas on sinks. After every step it publishes an :class:`EngineStats` snapshot, which
``stats()`` returns to any thread.

Ownership: the engine core (scheduler, KV cache manager and block pool, model runner) and the output
processor's per-request state are touched only by the thread that steps: the loop thread, or the caller of
``step()`` when no loop runs. Other threads go through the core's inbox (``add_request``, ``abort``), the
published stats snapshot (``stats``) or ``debug_snapshot``, which holds the stepping thread off while it
reads. ``shutdown`` tells the loop to stop; the loop thread itself aborts what is left (see ``shutdown``).

Health (vLLM's ``EngineDeadError``): after ``MAX_CONSECUTIVE_FAILED_STEPS`` steps in a row fail, or if the
loop thread dies, the engine is dead: what is in flight ends with ``error``, ``check_health`` and
``add_request`` raise :class:`~backend.errors.EngineDeadError`, and only a new engine serves again.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator

import torch

from backend import host_memory
from backend.attention import select_attention_backend
from backend.bad_words import bad_words_token_ids
from backend.block_pool import ALL_BLOCKS_CLEARED
from backend.config import EngineConfig, resolve_dtype
from backend.cpu_threads import run_on_fresh_thread
from backend.engine_core import CoreSnapshot, EngineCore
from backend.errors import EngineDeadError, EngineUnavailableError
from backend.model_loader import load_model
from backend.model_runner import kv_bytes_per_block, kv_shape
from backend.model_support import default_max_model_len, inspect_attention, max_positions
from backend.output_processor import OutputProcessor
from backend.outputs import RequestOutput
from backend.parallel_sampling import ParentRequest
from backend.prompt_limits import check_prompt_bytes, encode_prompt, max_prompt_bytes
from backend.sampling_params import SamplingParams
from backend.stats import EngineStats
from backend.structured_output import Grammar, GrammarCompiler, SchemaLimits

log = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.2  # of available memory (backend.host_memory), when the KV cache size is not given
CPU_KV_CAP_BYTES = 4 << 30
GPU_KV_FRACTION = 0.8  # of free device memory after loading the model
MAX_CACHE_SALT_CHARS = 256
MAX_CONSECUTIVE_FAILED_STEPS = 3  # then the engine is dead (a transient fault fails fewer steps)


class LLMEngine:
    """Continuous batching over a paged KV cache, driving an unmodified transformers causal LM (or the
    compact decoder of ``backend.models`` where the architecture allows).

    Thread-safe: ``add_request``, ``abort``, ``stats``, ``debug_snapshot``, ``check_health`` and
    ``shutdown`` may be called from any thread; the loop thread (``start``) or the caller of ``step`` (one
    of them, never both at once) does all the work. Each request's deltas go to a ``queue.Queue`` of
    :class:`RequestOutput`: each completion's last delta has ``finish_reason`` set, and the request's very
    last delta (of its last completion to finish, when ``n`` > 1) has ``done`` set.

    Attributes:
        step_log: None, or a list to which the engine appends the :class:`EngineStats` snapshot taken after
            every step that computed something (benchmarks set it; it grows without bound).
        engine_core: the :class:`EngineCore` that owns the scheduler, KV cache and model runner. Not part of
            the serving API: only the stepping thread may touch it beyond its inbox; tests that inject faults
            into the core reach it here while no loop thread runs. Inspect through ``debug_snapshot``.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        if config.device.startswith("cuda"):
            index = int(config.device.partition(":")[2] or 0)
            if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                raise ValueError(f"device {config.device}: torch {torch.__version__} here sees "
                                 f"{torch.cuda.device_count() if torch.cuda.is_available() else 'no'} CUDA device(s)")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, config.device, cpu_kernels=config.attention_backend in ("auto", "cpu")
                                   and config.model_impl == "auto" and config.model_runner == "default")
        # Loading runs torch operations; on a thread of its own, so the thread that steps owns the process's
        # only OpenMP pool (backend.cpu_threads: two pools make every barrier sleep).
        run_on_fresh_thread(lambda: self._build(config))
        self.step_log: list[EngineStats] | None = None
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()  # held by start and shutdown
        self._step_lock = threading.Lock()  # held while the core or the output processor changes
        self._stopping = False
        # Held while a request enters the core and while shutdown raises _stopping: a request is either in the
        # core before the stop (and aborted with the rest) or refused, never queued after the last abort.
        self._admit_lock = threading.Lock()
        self._dead: str | None = None  # why the engine is dead, once it is
        self._num_steps = 0
        self._last_step = (0, 0, 0)
        self._stats_lock = threading.Lock()
        self._stats = self._make_stats()

    def _build(self, config: EngineConfig) -> None:
        """Loads the model and tokenizer and builds the engine core (on the loading thread)."""
        model, self.tokenizer = load_model(config.model, self.dtype, config.device)
        self.model_config = model.config
        self.model_attention = inspect_attention(model)  # refuses what the engine cannot run exactly
        log.info("%s attention: %s", model.config.model_type, self.model_attention.describe())
        positions = max_positions(model.config)
        if config.max_model_len and positions and config.max_model_len > positions:
            raise ValueError(f"max_model_len {config.max_model_len} is beyond the model's {positions} positions "
                             f"(max_position_embeddings and its rotary scaling); past them its outputs are undefined. "
                             f"Set max_model_len to at most {positions}, or to \"\" for the model's own")
        self.max_model_len = config.max_model_len or default_max_model_len(model.config)
        self.eos_token_ids = _eos_token_ids(model, self.tokenizer)
        self.max_prompt_bytes = max_prompt_bytes(self.tokenizer, self.max_model_len)  # checked before tokenizing
        num_blocks = config.num_blocks or self._blocks_from_memory(model)
        self._check_pool_fits(model, num_blocks)
        attn_backend = None  # the zero-cost runner runs no model
        if config.model_runner == "default":
            attn_backend = select_attention_backend(config.attention_backend, model.device, model.dtype,
                                                    kv_shape(model.config)[1])
        self.engine_core = EngineCore(config, model, self.max_model_len, num_blocks, attn_backend,
                                      sliding_window=self.model_attention.uniform_sliding_window)
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval)
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer, model.config.vocab_size,
            schema_limits=SchemaLimits(config.structured_outputs_max_schema_bytes,
                                       config.structured_outputs_max_schema_depth,
                                       config.structured_outputs_max_schema_keywords),
            compile_timeout=config.structured_outputs_compile_timeout)
        self.kv_events = None  # the KV cache events publisher, when configured
        if config.kv_events_endpoint is not None:
            from backend.kv_events import KVEventPublisher

            self.kv_events = KVEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint,
                                              config.kv_events_topic, config.block_size, config.kv_events_encoding)
            self.engine_core.enable_kv_events()
        # The loaded model's own weights, replaced by the runner's packed copies, go with `model` (and any cycle
        # holding them with the collection); the allocator then hands them back to the OS instead of keeping them
        # resident (tcmalloc keeps freed memory: the 1.7B shape in fp32 stayed at 18.0 GB resident instead of 11.8).
        del model
        gc.collect()
        host_memory.release_free_memory()

    # -- public API ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | bytes | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, sink: queue.Queue | None = None, priority: int = 0,
                    timeout: float | None = None, cache_salt: str | None = None,
                    fairness_key: str | None = None) -> queue.Queue:
        """Validates and queues a request.

        Args:
            prompt: text (UTF-8 ``bytes`` accepted) or token ids.
            sink: where this request's :class:`RequestOutput` deltas go; a new queue when None
                (several requests may share one, e.g. the Triton model's sender thread).
            priority: lower values are scheduled first and preempted last (vLLM's priority policy); 0 default.
            timeout: seconds from now; then the request ends at the next step with finish_reason ``timeout``
                and the output so far, waiting or running. None: no deadline.
            cache_salt: prefix-cache blocks are shared only among requests with the same salt (vLLM's
                ``cache_salt``: tenants that must not learn of each other's prompts through cache timing);
                at most ``MAX_CACHE_SALT_CHARS`` characters.
            fairness_key: requests with the same key take one turn together in admission (the scheduler's
                start-time fair queuing): the prompts of one multi-prompt call, or one tenant's requests.
                None: the request (its ``n`` completions) is a key of its own. At most
                ``MAX_CACHE_SALT_CHARS`` characters.

        Returns:
            The sink.

        ``params.max_tokens`` past the context is held to it: the request ends at ``max_model_len`` with
        finish_reason ``length`` (as vLLM caps it); ``min_tokens`` past it is refused.

        A request with ``params.structured_outputs`` has its constraint checked (a JSON schema keyword the
        grammar would not enforce is refused) and its grammar compiled before it is queued, the caller waiting
        at most ``structured_outputs_compile_timeout`` (once per distinct constraint: cached); the engine loop
        never compiles.

        Raises:
            ValueError: empty prompt, invalid UTF-8, token ids outside the vocabulary, a request that can
                never fit (over ``max_prompt_bytes`` before tokenizing, over ``max_model_len`` after (with
                ``min_tokens``), or bigger than the whole KV cache), a duplicate request id, a ``timeout`` that is not a
                positive number, or an invalid, unenforceable, oversized or too slow to compile schema, regex
                or grammar in ``structured_outputs``. Nothing is queued then; other requests are unaffected.
            EngineOverloadedError: the waiting queue is full (``max_num_waiting_requests`` /
                ``max_num_waiting_tokens``), or the grammar compiler was busy past the compile timeout;
                nothing is queued.
            EngineDeadError: the engine is dead (:meth:`check_health`).
            EngineUnavailableError: :meth:`shutdown` has begun (until :meth:`start` runs the loop again).
        """
        self.check_health()
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        params = params or SamplingParams()
        self.check_request(params, cache_salt, fairness_key)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        prompt_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-params.truncate_prompt_tokens:]
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt plus at least one output token must fit)")
        # max_tokens is a bound: past the context the request ends at max_model_len (finish_reason length), as
        # vLLM caps it; min_tokens is a promise, so it must fit.
        room = self.max_model_len - len(prompt_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.min_tokens > room:
            raise ValueError(f"min_tokens ({params.min_tokens}) does not fit: prompt ({len(prompt_ids)} tokens) + "
                             f"min_tokens exceeds max_model_len ({self.max_model_len})")
        self.engine_core.check_fits(len(prompt_ids), max_tokens)
        make_grammar = None
        if params.structured_outputs is not None:
            compiled = self.grammar_compiler.compile(params.structured_outputs)
            make_grammar = lambda: Grammar(compiled, self.eos_token_ids)  # noqa: E731
        sink = sink if sink is not None else queue.Queue()
        parent = ParentRequest(request_id, params, sink)
        requests = parent.make_requests(prompt_ids, self.eos_token_ids, max_tokens,
                                        bad_words_token_ids(self.tokenizer, params.bad_words),
                                        self.config.enable_prefix_caching, priority, timeout, make_grammar,
                                        cache_salt, fairness_key)
        with self._admit_lock:
            if self._stopping:
                raise EngineUnavailableError("the engine is shutting down")
            self.output_processor.add_request(parent, requests)  # raises on a duplicate id
            try:
                self.engine_core.add_requests(requests)
            except Exception:
                self.output_processor.remove_request(parent)
                raise
        return sink

    def check_request(self, params: SamplingParams, cache_salt: str | None = None,
                      fairness_key: str | None = None) -> None:
        """The checks of :meth:`add_request` that need neither the prompt nor a compiled constraint: the
        settings against the engine's limits (``max_n``, the vocabulary).

        Raises:
            ValueError: ``cache_salt`` or ``fairness_key`` not a string of 1-256 characters, ``n`` over
                ``max_n``, a token id in ``stop_token_ids``, ``logit_bias`` or ``allowed_token_ids`` outside
                the vocabulary.
        """
        for name, value in (("cache_salt", cache_salt), ("fairness_key", fairness_key)):
            if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_CACHE_SALT_CHARS):
                raise ValueError(f"{name} must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if params.n > self.config.max_n:
            raise ValueError(f"n must be at most {self.config.max_n} (the engine's max_n), got {params.n}")
        vocab = self.model_config.vocab_size
        outside = [t for t in params.token_ids_used() if t >= vocab]
        if outside:
            raise ValueError(f"token id {outside[0]} (in stop_token_ids, logit_bias or allowed_token_ids) is "
                             f"outside the vocabulary [0, {vocab})")

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Ends a request, or several (each with all its completions), with finish_reason ``abort`` at the next
        step; their blocks are freed then. Several ids are taken at once (as vLLM's ``abort_request`` takes a
        list): no step falls between them, so a waiting request aborted with running ones is never admitted to
        the slots they free. Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        self.engine_core.abort_requests([child for rid in ids for child in self.output_processor.child_ids(rid)])

    def generate(self, prompt: str | bytes | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> Iterator[RequestOutput]:
        """Streams one request's deltas (of all its completions), starting the loop thread if needed."""
        self.start()
        sink = self.add_request(prompt, params, request_id)
        while True:
            out = sink.get()
            yield out
            if out.done:
                return

    def check_health(self) -> None:
        """Returns if the engine can serve (vLLM's ``check_health``).

        Raises:
            EngineDeadError: ``MAX_CONSECUTIVE_FAILED_STEPS`` steps failed in a row, or the loop thread died.
        """
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stopping:
            raise EngineDeadError("engine is dead: its loop thread died")

    def request_ids(self) -> list[str]:
        """The ids of the requests in flight (as given to ``add_request``), waiting or running."""
        return self.output_processor.parent_ids()

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step, plus the requests added since (counted as waiting)."""
        with self._stats_lock:
            stats = self._stats
        core = self.engine_core
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + core.num_inbox_requests,
                                   num_rejected=core.num_rejected)

    def debug_snapshot(self) -> CoreSnapshot:
        """The engine core's state as plain data (running and waiting ids, blocks, runner), for tests and
        tools; not for serving decisions.

        Taken between steps: it waits for the step in progress, if any, to finish (milliseconds to the
        length of one forward pass), so it never sees a half-applied step.
        """
        with self._step_lock:
            return self.engine_core.snapshot()

    def reset_prefix_cache(self) -> bool:
        """Forgets every prefix-cached block (vLLM's ``LLMEngine.reset_prefix_cache``), between steps. Only
        while no request holds blocks: returns False, changing nothing, while one does; True once reset."""
        with self._step_lock:
            return self.engine_core.reset_prefix_cache()

    # -- the loop -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the background loop thread (idempotent). After a ``shutdown`` whose loop was still in a
        step, first waits for that loop to end."""
        with self._thread_lock:
            if self._thread is not None:
                if not self._stopping:
                    return
                self._thread.join()  # a loop told to stop; it aborts what is left, then ends
            self._stopping = False
            self._thread = threading.Thread(target=self._run_loop, name="llm-engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still in flight end with finish_reason ``abort``, and the KV cache events
        publisher (if any) announces the cache cleared and closes.

        Who does the aborting: the loop thread, when it sees the stop (after the step in progress); this
        call waits up to ``timeout`` seconds for it. When no loop thread runs (never started, or ended after
        the engine died), this call does it, holding the lock that ``start`` takes, so no other thread steps
        meanwhile. If the loop is still inside a step after ``timeout``, this call returns without touching
        the core (logged); the loop thread aborts what is left when that step ends. From the moment this
        call begins, :meth:`add_request` refuses with :class:`EngineUnavailableError`: every request is
        either answered (aborted, at worst) or refused.
        """
        with self._thread_lock:
            with self._admit_lock:
                self._stopping = True
            thread = self._thread
            self.engine_core.wake()
            self.grammar_compiler.close()  # its worker processes (a compile in progress: 503); a restart starts new ones
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():  # kept in self._thread: start() waits for it
                    log.warning("engine loop still in a step after %.1f s; it aborts what is left when the "
                                "step ends", timeout)
                    return
            self._thread = None
            self._abort_all()  # the loop is gone (or already did this: then there is nothing left)

    def _abort_all(self) -> None:
        """Ends every request with ``abort`` and closes the KV events publisher (stepping thread only)."""
        with self._step_lock:
            self._deliver(self.output_processor.make_outputs([], self.engine_core.abort_all(), {}))
            kv_events, self.kv_events = self.kv_events, None
            if kv_events is not None:  # the cache goes away with the engine
                kv_events.publish([*self.engine_core.take_kv_events(), (ALL_BLOCKS_CLEARED,)])
                kv_events.shutdown()

    def _run_loop(self) -> None:
        while True:
            self.engine_core.wait_for_work()
            if self._stopping:
                self._abort_all()
                return
            core = self.engine_core
            try:
                self.step()
            except Exception as exc:  # a bug must not kill the loop: fail what is in flight, keep serving
                log.exception("engine step failed")
                with self._step_lock:
                    core.num_consecutive_failed_steps += 1
                    core.last_step_error = f"engine error: {exc}"
                    self._check_failures()
                    self._deliver(self.output_processor.make_outputs([], core.fail_all(core.last_step_error), {}))
            if self._dead is not None:
                log.error("%s; refusing requests until restarted", self._dead)
                with self._step_lock:
                    self._deliver(self.output_processor.make_outputs([], core.fail_all(self._dead), {}))
                return

    def _check_failures(self) -> None:
        """Declares the engine dead after ``MAX_CONSECUTIVE_FAILED_STEPS`` failed steps in a row."""
        core = self.engine_core
        if core.num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS and self._dead is None:
            self._dead = (f"engine is dead: {core.num_consecutive_failed_steps} steps failed in a row "
                          f"(last: {core.last_step_error})")

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling + forward + sampling step and delivers the deltas to the sinks.

        Call it from one thread at a time, and not while the loop thread runs (``start``).

        Returns:
            The deltas produced (also put on each request's sink).
        """
        with self._step_lock:
            return self._step()

    def _step(self) -> list[RequestOutput]:
        core_out = self.engine_core.step()
        kv_events = self.kv_events
        if kv_events is not None:
            kv_events.publish(self.engine_core.take_kv_events())
        if core_out.sched is not None:
            sched = core_out.sched
            self._num_steps += 1
            self._last_step = (len(sched.scheduled), sched.num_prefills, sched.total_num_scheduled_tokens)
        # Stop strings live in text, which only the output processor has: it reports the requests whose
        # text reached one, and the core ends them (the rule is backend.stopping's) before deltas are made.
        stopped = self.output_processor.detokenize(core_out.new_token)
        self.engine_core.finish_on_stop_strings(stopped)
        deltas = self.output_processor.make_outputs(core_out.new_token, core_out.ended, core_out.logprobs,
                                                    core_out.prompt_logprobs)
        self._check_failures()  # before delivering: whoever sees a failed request sees the engine's health
        stats = self._deliver(deltas)
        if self.step_log is not None and core_out.sched is not None:
            self.step_log.append(stats)
        return [out for _, out in deltas]

    def _deliver(self, deltas: list[tuple[queue.Queue, RequestOutput]]) -> EngineStats:
        """Publishes the stats snapshot, then puts the deltas on their sinks (so a reader of a final delta
        who asks for stats sees its blocks freed)."""
        stats = self._make_stats()
        with self._stats_lock:
            self._stats = stats
        for sink, out in deltas:
            sink.put(out)
        return stats

    def _make_stats(self) -> EngineStats:
        sched = self.engine_core.make_stats()
        scheduled, prefills, tokens = self._last_step
        out = self.output_processor
        return EngineStats(
            num_running=sched.num_running, num_waiting=sched.num_waiting, kv=sched.kv,
            max_num_seqs=self.config.max_num_seqs, num_preemptions=sched.num_preemptions,
            prompt_tokens=out.prompt_tokens, generation_tokens=out.generation_tokens, num_steps=self._num_steps,
            finished=dict(out.finished), last_step_num_scheduled=scheduled, last_step_num_prefills=prefills,
            last_step_num_tokens=tokens, num_computed_tokens=sched.num_computed_tokens,
            spec_decode_num_drafts=sched.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=sched.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=sched.spec_decode_num_accepted_tokens, time=time.perf_counter())

    # -- helpers ------------------------------------------------------------------------------------
    def _tokenize(self, prompt: str | bytes | list[int]) -> list[int]:
        if isinstance(prompt, (str, bytes, bytearray)):
            check_prompt_bytes(prompt, self.max_prompt_bytes, self.max_model_len)
        if isinstance(prompt, (bytes, bytearray)):
            try:
                prompt = bytes(prompt).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"prompt is not valid UTF-8: {exc}") from None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return encode_prompt(self.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)):
            return self.check_prompt_token_ids(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def check_prompt_token_ids(self, prompt: list[int] | tuple[int, ...]) -> list[int]:
        """``prompt`` as a list, checked as ``add_request`` checks a prompt of token ids (before anything, such
        as echoing the prompt's text, decodes them).

        Raises:
            ValueError: empty, or an id that is not an integer in ``[0, vocab_size)``.
        """
        if not prompt:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        for token_id in prompt:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {token_id!r}")
        return list(prompt)

    def _blocks_from_memory(self, model) -> int:
        per_block = kv_bytes_per_block(model.config, self.config.block_size, next(model.parameters()).dtype)
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if model.device.type == "cuda":
                budget = int(torch.cuda.mem_get_info(model.device)[0] * GPU_KV_FRACTION)
            else:
                budget = min(int(host_memory.available_bytes() * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no block ({per_block} bytes each)")
        return num_blocks

    def _check_pool_fits(self, model, num_blocks: int) -> None:
        """Refuses a KV pool larger than the host's whole memory (CPU): the allocation could only fail, or the
        machine swap; named as the setting that asked for it.

        Raises:
            ValueError: naming ``num_blocks`` or ``kv_cache_memory_bytes`` and the sizes.
        """
        if model.device.type != "cpu":
            return  # the CUDA allocator's own error names the bytes
        size = num_blocks * kv_bytes_per_block(model.config, self.config.block_size, next(model.parameters()).dtype)
        total = host_memory.total_bytes()
        if total is not None and size > total:
            setting = "num_blocks" if self.config.num_blocks else "kv_cache_memory_bytes"
            raise ValueError(f"{setting} asks for a KV cache of {size} bytes ({num_blocks} blocks of "
                             f"{self.config.block_size} tokens), more than this machine's {total} bytes of memory")


def _eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    ids = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return tuple(sorted(ids))
