"""The engine core (vLLM v1's ``EngineCore``): inbox -> schedule -> execute -> update, on engine requests.

It knows no text, sinks or caller ids: it takes :class:`Request` objects and aborts (thread-safe inbox),
runs ``Scheduler.schedule()`` -> ``ModelRunner.execute()`` -> ``Scheduler.update_from_output()`` and
returns which requests gained a token or ended (:class:`EngineCoreOutput`). The output processor turns
those into deltas.

Admission control lives here because the inbox does: ``add_requests`` refuses work past the bound on
waiting requests and tokens (:class:`~backend.errors.EngineOverloadedError`), counted against the
scheduler's waiting queue as of the last step plus the inbox. Deadlines too: each step first ends the
requests whose ``deadline`` has passed (``FINISHED_TIMEOUT``), waiting or running, freeing their blocks.

Ownership: the scheduler, the KV cache manager (and its block pool) and the model runner belong to the one
thread that steps the core (the engine's loop thread, or the caller of ``LLMEngine.step`` when no loop
runs). Other threads reach the core only through the inbox (``add_requests``, ``abort_requests``,
``wake``), the counters published under the inbox's lock (``num_inbox_requests``, ``num_rejected``) and
``check_fits``, which reads configuration fixed at construction.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from backend.attention import AttentionBackend
from backend.config import EngineConfig
from backend.cpu_threads import plan_binding
from backend.errors import NO_TOKEN_MESSAGE, EngineOverloadedError
from backend.fault_injection import FaultInjector
from backend.kv_cache_manager import KVCacheManager
from backend.model_runner import ModelRunner
from backend.request import Request, RequestStatus
from backend.sampler import NO_TOKEN, TokenLogprobs
from backend.scheduler import Scheduler
from backend.scheduler_output import SchedulerOutput
from backend.stats import SchedulerStats
from backend.zero_cost_runner import ZeroCostModelRunner

log = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """What one step changed.

    Attributes:
        new_token: requests that got one or more tokens (several after a speculative decode; finished ones
            included).
        ended: requests that ended without a token (aborted, timed out, or failed with ``error`` set).
        logprobs: request id -> logprobs of its new token, for requests that asked.
        prompt_logprobs: request id -> (index of the first prompt token scored, entries), for requests that
            asked for prompt logprobs and computed prompt positions this step (with or without a new token).
        sched: what was scheduled (None when the step only took its inbox).
    """

    new_token: list[Request] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    sched: SchedulerOutput | None = None


class EngineCore:
    """Owns the KV cache manager, the scheduler and the model runner; steps them.

    ``add_requests``, ``abort_requests``, ``check_fits``, ``num_inbox_requests``, ``wait_for_work`` and
    ``wake`` may be called from any thread; everything else from the one thread that steps (or, for
    ``snapshot``, from a thread that holds the stepping thread off, as ``LLMEngine.debug_snapshot`` does).
    """

    def __init__(self, config: EngineConfig, model, max_model_len: int, num_blocks: int,
                 attn_backend: type[AttentionBackend] | None, sliding_window: int | None = None) -> None:
        """``attn_backend``: the selector's choice (None for the zero-cost runner, which runs no model);
        ``sliding_window``: the window every layer of the model attends through, if any (the KV cache manager
        then frees the blocks behind it)."""
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                               sliding_window=sliding_window)
        self.scheduler = Scheduler(config, self.kv_cache_manager, max_model_len)
        cpu_threads = None
        if attn_backend is not None and attn_backend.uses_cpu_ops:  # pinning goes through the CPU kernels' extension
            cpu_threads = plan_binding(config.cpu_threads_bind, torch.get_num_threads())
        elif config.cpu_threads_bind not in ("auto", "off"):
            raise ValueError(f"cpu_threads_bind {config.cpu_threads_bind!r} pins threads through the C++ CPU kernels, "
                             f"which this engine does not run (attention backend "
                             f"{getattr(attn_backend, 'name', None) or config.attention_backend}, model runner "
                             f"{config.model_runner}): use auto or off")
        if config.model_runner == "zero_cost":  # benchmarks of everything but the forward pass
            self.model_runner = ZeroCostModelRunner(model.config.vocab_size)
        else:
            self.model_runner = ModelRunner(model, num_blocks, config.block_size, max_model_len, attn_backend,
                                            compact=config.model_impl == "auto", cpu_threads=cpu_threads,
                                            quantization=config.quantization)
            if config.cuda_graphs != "off":
                self.model_runner.capture_decode_graphs(config.max_num_seqs, emulate=config.cuda_graphs == "emulate")
        self._cond = threading.Condition()
        self._new: list[Request] = []
        self._aborts: list[str] = []
        self._woken = False
        self._requests: dict[str, Request] = {}  # unfinished requests taken from the inbox, by id
        self.max_num_waiting_requests = config.max_num_waiting_requests
        self.max_num_waiting_tokens = config.max_num_waiting_tokens
        self._num_inbox_tokens = 0
        self._num_waiting = 0  # the scheduler's waiting queue as of the last step (read under _cond)
        self._num_waiting_tokens = 0
        self.num_rejected = 0  # requests refused by add_requests since start
        self._deadlines: list[tuple[float, int, Request]] = []  # heap of (deadline, tie-break, request)
        self._tiebreak = itertools.count()
        self.fault_injector = FaultInjector()
        self.num_consecutive_failed_steps = 0
        self.last_step_error: str | None = None

    # -- inbox (any thread) -------------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        """Queues requests for the next step (all or none).

        Raises:
            EngineOverloadedError: with them, more than ``max_num_waiting_requests`` requests or
                ``max_num_waiting_tokens`` tokens would wait (never when nothing waits).
        """
        tokens = sum(r.num_tokens for r in requests)
        with self._cond:
            num_waiting = self._num_waiting + len(self._new)
            num_tokens = self._num_waiting_tokens + self._num_inbox_tokens
            if num_waiting and (num_waiting + len(requests) > self.max_num_waiting_requests
                                or num_tokens + tokens > self.max_num_waiting_tokens):
                self.num_rejected += 1
                raise EngineOverloadedError(
                    f"server is full: {num_waiting} requests ({num_tokens} tokens) already waiting, at most "
                    f"{self.max_num_waiting_requests} requests and {self.max_num_waiting_tokens} tokens; "
                    f"retry later")
            self._new.extend(requests)
            self._num_inbox_tokens += tokens
            self._cond.notify()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Aborted at the next step (before it schedules); unknown or finished ids are ignored."""
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Rejects a request that could never run (``Scheduler.check_fits``); reads only the limits fixed at
        construction (``max_model_len``, the pool's size), so any thread may call it.

        Raises:
            ValueError: prompt + max_tokens over max_model_len, or more blocks than the whole pool.
        """
        self.scheduler.check_fits(prompt_len, max_tokens)

    @property
    def num_inbox_requests(self) -> int:
        with self._cond:
            return len(self._new)

    def wait_for_work(self) -> None:
        """Blocks until there is something to do or :meth:`wake` is called."""
        with self._cond:
            while not (self._new or self._aborts or self._requests or self._woken):
                self._cond.wait()
            self._woken = False

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    # -- the step (engine thread) -------------------------------------------------------------------
    def take_inbox(self) -> list[Request]:
        """Queues new requests in the scheduler and ends aborted ones.

        Returns:
            The requests aborted now.
        """
        with self._cond:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            self._num_waiting += len(new)  # counted as waiting until the scheduler's count replaces it
            self._num_waiting_tokens += self._num_inbox_tokens
            self._num_inbox_tokens = 0
        for request in new:
            self._requests[request.request_id] = request
            self.scheduler.add_request(request)
            if request.deadline is not None:
                heapq.heappush(self._deadlines, (request.deadline, next(self._tiebreak), request))
        ended = []
        for request_id in aborts:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
                ended.append(request)
        return ended

    def step(self) -> EngineCoreOutput:
        """Takes the inbox, then one scheduling + forward + sampling step.

        Requests past their deadline end first (``FINISHED_TIMEOUT``, in ``ended``). A failed forward pass
        ends the step's requests with ``FINISHED_ERROR`` (in ``ended``) and counts in
        ``num_consecutive_failed_steps``; others go on. A request whose own masks left the sampler no token
        (``NO_TOKEN``) ends alone with ``FINISHED_ERROR`` and ``NO_TOKEN_MESSAGE`` (in ``ended``).
        """
        out = EngineCoreOutput(ended=self.take_inbox())
        started = time.monotonic()
        out.ended += self._expire(started)
        sched = self.scheduler.schedule()
        self._publish_waiting()
        if sched.is_empty:
            return out
        out.sched = sched
        try:
            self.fault_injector.check()
            result = self.model_runner.execute(sched)
        except Exception as exc:
            log.exception("forward pass failed for %d requests", len(sched.scheduled))
            self.num_consecutive_failed_steps += 1
            self.last_step_error = f"forward pass failed: {exc}"
            for request in sched.requests:
                if not request.is_finished:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, self.last_step_error)
                    out.ended.append(self._requests.pop(request.request_id))
            self._publish_waiting()
            return out
        self.num_consecutive_failed_steps = 0
        for request in sched.requests:  # its own masks left it no token: it ends, the others go on
            if result.sampled.get(request.request_id) == NO_TOKEN and not request.is_finished:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, NO_TOKEN_MESSAGE)
                out.ended.append(self._requests.pop(request.request_id))
        out.new_token = self.scheduler.update_from_output(sched, result.sampled, result.verified)
        self.scheduler.observe_step(sched, time.monotonic() - started)
        out.logprobs = result.logprobs
        out.prompt_logprobs = result.prompt_logprobs
        for request in out.new_token:
            if request.is_finished:
                del self._requests[request.request_id]
        return out

    def _expire(self, now: float) -> list[Request]:
        """Ends the unfinished requests whose deadline (``time.monotonic`` seconds) is at or before ``now``."""
        ended = []
        while self._deadlines and self._deadlines[0][0] <= now:
            request = heapq.heappop(self._deadlines)[2]
            if not request.is_finished and self._requests.get(request.request_id) is request:
                del self._requests[request.request_id]
                self.scheduler.finish_request(request, RequestStatus.FINISHED_TIMEOUT)
                ended.append(request)
        if len(self._deadlines) > 2 * len(self._requests) + 64:  # drop requests that finished before their deadline
            self._deadlines = [entry for entry in self._deadlines if not entry[2].is_finished]
            heapq.heapify(self._deadlines)
        return ended

    def _publish_waiting(self) -> None:
        with self._cond:
            self._num_waiting = len(self.scheduler.waiting)
            self._num_waiting_tokens = self.scheduler.num_waiting_tokens

    def finish_on_stop_strings(self, requests: list[tuple[Request, int | None]]) -> None:
        """Ends the requests whose text reached a stop string (stepping thread): (request, the output token the
        stop string ends in when it is not the last, else None; the tokens after it are dropped).

        The output processor finds stop strings in the text it detokenized this step and reports the
        requests; the core applies them here, on the stepping thread, before the step's deltas are built.
        Whether a match ends the request (and as ``stop`` or ``length``) is decided by
        :func:`backend.stopping.stop_status`, through ``Scheduler.finish_on_stop_string``."""
        for request, num_output_tokens in requests:
            self.scheduler.finish_on_stop_string(request, num_output_tokens)
            if request.is_finished:
                self._requests.pop(request.request_id, None)

    def fail_all(self, error: str) -> list[Request]:
        """Ends every request, queued or not yet taken, with ``FINISHED_ERROR``; returns them."""
        ended = self.take_inbox()
        failed = list(self._requests.values())
        self._requests.clear()
        for request in failed:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, error)
        self._deadlines.clear()
        self._publish_waiting()
        return ended + failed

    def abort_all(self) -> list[Request]:
        """Ends every request, queued or not yet taken from the inbox, with ``FINISHED_ABORTED``, freeing
        their blocks; returns them (stepping thread: the engine's loop thread when it stops)."""
        ended = self.take_inbox()
        aborted = list(self._requests.values())
        self._requests.clear()
        for request in aborted:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        self._deadlines.clear()
        self._publish_waiting()
        return ended + aborted

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    # -- KV cache events (stepping thread) ----------------------------------------------------------
    def enable_kv_events(self) -> None:
        """Makes the block pool record its stored/removed/cleared events (``BlockPool.enable_events``)."""
        self.kv_cache_manager.pool.enable_events()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block's content when no request holds blocks (``BlockPool.reset_prefix_cache``);
        False, changing nothing, while one does."""
        return self.kv_cache_manager.pool.reset_prefix_cache()

    def take_kv_events(self) -> list[tuple]:
        """The block pool's events since the last call, oldest first (``BlockPool.take_events``)."""
        return self.kv_cache_manager.pool.take_events()

    # -- inspection (stepping thread, or with it held off) ------------------------------------------
    def snapshot(self) -> CoreSnapshot:
        """Plain data on the scheduler, KV cache and model runner, for tests and tools."""
        kv, pool, runner = self.kv_cache_manager, self.kv_cache_manager.pool, self.model_runner
        attn_backend = getattr(runner, "attn_backend", None)
        decoder = getattr(runner, "decoder", None)
        return CoreSnapshot(
            running=tuple(r.request_id for r in self.scheduler.running),
            waiting=tuple(r.request_id for r in self.scheduler.waiting),
            num_preemptions=self.scheduler.make_stats().num_preemptions,
            num_blocks=kv.num_blocks, num_free_blocks=pool.num_free_blocks, num_evictions=pool.num_evictions,
            prefix_cache_queries=kv.prefix_cache_queries, cached_block_hashes=frozenset(pool.cached_hashes()),
            requests_with_blocks=frozenset(kv.block_tables),
            sliding_window=kv.sliding_window, model_runner=type(runner).__name__,
            attention_backend=attn_backend.name if attn_backend is not None else None,
            decoder=type(decoder).__name__ if decoder is not None else None)


@dataclass(frozen=True)
class CoreSnapshot:
    """The engine core's state at one moment, as plain data (:meth:`EngineCore.snapshot`).

    Attributes:
        running: ids of the scheduler's running requests (completion ids when ``n`` > 1), in schedule order.
        waiting: ids of its waiting requests, in the order they will be admitted.
        num_preemptions: requests preempted since start.
        num_blocks: KV cache blocks in all; num_free_blocks: free ones now (cached prefixes included);
        num_evictions: cached blocks reused for other content since start.
        prefix_cache_queries: prompt tokens looked up in the prefix cache since start.
        cached_block_hashes: the full hashes of the blocks the prefix cache can find now.
        requests_with_blocks: ids of the requests that hold KV blocks now.
        sliding_window: the window (tokens) behind which the KV cache frees blocks, or None.
        model_runner: the runner's class name (``ModelRunner`` or ``ZeroCostModelRunner``).
        attention_backend: the attention backend's name, or None (the zero-cost runner runs no model).
        decoder: the compact decoder's class name, or None when transformers' model runs (or no model).
    """

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    num_evictions: int
    prefix_cache_queries: int
    cached_block_hashes: frozenset[bytes]
    requests_with_blocks: frozenset[str]
    sliding_window: int | None
    model_runner: str
    attention_backend: str | None
    decoder: str | None
