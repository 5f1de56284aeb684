"""The engine: the step loop that ties scheduler, model runner and detokenizer together.

``step()`` reads top to bottom: take new requests and aborts -> ``Scheduler.schedule()`` ->
``ModelRunner.execute()`` -> ``Scheduler.update_from_output()`` -> detokenize, stop strings -> deltas.
A background thread calls ``step()`` while there is work (continuous batching, Orca, Yu et al. OSDI 2022).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from backend.bad_words import bad_words_token_ids
from backend.config import EngineConfig, resolve_dtype
from backend.detokenizer import IncrementalDetokenizer
from backend.kv_cache_manager import KVCacheManager, KVCacheUsage
from backend.model_loader import load_model
from backend.model_runner import ModelRunner, kv_bytes_per_block
from backend.model_support import inspect_attention
from backend.outputs import RequestMetrics, RequestOutput
from backend.prompt_limits import check_prompt_bytes, max_prompt_bytes
from backend.request import Request, RequestStatus
from backend.sampling_params import SamplingParams
from backend.scheduler import Scheduler

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192
CPU_KV_FRACTION = 0.2  # of available memory, when the KV cache size is not given
CPU_KV_CAP_BYTES = 4 << 30
GPU_KV_FRACTION = 0.8  # of free device memory after loading the model


@dataclass
class EngineStats:
    """A live snapshot for metrics. Counters are totals since start; ``last_step_*`` describe the latest step."""

    num_running: int
    num_waiting: int
    kv: KVCacheUsage
    max_num_seqs: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    finished: dict[str, int] = field(default_factory=dict)
    last_step_num_scheduled: int = 0
    last_step_num_prefills: int = 0
    last_step_num_tokens: int = 0


@dataclass
class _Live:
    request: Request
    detokenizer: IncrementalDetokenizer
    sink: queue.Queue
    parent_id: str  # the id the caller gave; completions of an n > 1 request share it
    unfinished: list[int]  # shared by a request's completions: how many are still going


class LLMEngine:
    """Continuous batching over a paged KV cache, driving an unmodified transformers causal LM.

    Thread-safe: ``add_request`` and ``abort`` may be called from any thread; the loop thread (``start``)
    or the caller of ``step`` does all the work. Each request's deltas go to a ``queue.Queue`` of
    :class:`RequestOutput`; the last one has ``finish_reason`` set.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, config.device)
        model, self.tokenizer = load_model(config.model, self.dtype, config.device)
        self.model_config = model.config
        self.model_attention = inspect_attention(model)  # refuses what the engine cannot run exactly
        log.info("%s attention: %s", model.config.model_type, self.model_attention.describe())
        self.max_model_len = config.max_model_len or min(
            getattr(model.config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN), DEFAULT_MAX_MODEL_LEN)
        self.eos_token_ids = _eos_token_ids(model, self.tokenizer)
        self.max_prompt_bytes = max_prompt_bytes(self.tokenizer, self.max_model_len)  # checked before tokenizing
        num_blocks = config.num_blocks or self._blocks_from_memory(model)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                               sliding_window=self.model_attention.uniform_sliding_window)
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.max_model_len)
        on_cuda = model.device.type == "cuda"
        use_kernels = config.use_kernels if config.use_kernels is not None else on_cuda
        cpu_kernel = config.use_kernels is None and not on_cuda and _cpu_kernels_available()
        self.model_runner = ModelRunner(model, self.kv_cache_manager, use_kernels, self.max_model_len,
                                        compact=config.model_impl == "auto", cpu_kernel=cpu_kernel)

        self.before_step: Callable[[], None] | None = None  # called by the loop thread before every step
        self._live: dict[str, _Live] = {}
        self._cond = threading.Condition()
        self._new: list[_Live] = []
        self._groups: dict[str, list[str]] = {}  # caller's request id -> its completions' ids
        self._aborts: list[str] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._num_steps = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished: Counter[str] = Counter()
        self._last_step = (0, 0, 0)

    # -- public API ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | bytes | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, sink: queue.Queue | None = None) -> queue.Queue:
        """Validates and queues a request.

        Args:
            prompt: text (UTF-8 ``bytes`` accepted) or token ids.
            sink: where this request's :class:`RequestOutput` deltas go; a new queue when None
                (several requests may share one, e.g. the Triton model's sender thread).

        Returns:
            The sink.

        Raises:
            ValueError: empty prompt, invalid UTF-8, token ids outside the vocabulary, a request that can
                never fit (over ``max_prompt_bytes`` before tokenizing, over ``max_model_len`` after, or
                bigger than the whole KV cache), or a duplicate request id. Nothing is queued then; other
                requests are unaffected.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        prompt_ids = self._tokenize(prompt)
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt plus at least one output token must fit)")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt_ids)
        self.scheduler.check_fits(len(prompt_ids), max_tokens)
        sink = sink if sink is not None else queue.Queue()
        unfinished = [params.n]
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        group = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(child_id, prompt_ids, params, self.eos_token_ids, max_tokens, index, bad_words)
            group.append(_Live(request, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                               params.stop), sink, request_id, unfinished))
        group[0].request.forks = [live.request for live in group[1:]]
        with self._cond:
            if request_id in self._groups:
                raise ValueError(f"request id {request_id!r} is already in flight")
            self._groups[request_id] = [live.request.request_id for live in group]
            self._new.extend(group)
            self._cond.notify()
        return sink

    def abort(self, request_id: str) -> None:
        """Ends a request (all its completions) with finish_reason ``abort`` at the next step; its blocks are
        freed then. Unknown or finished ids are ignored."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

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

    def has_unfinished_requests(self) -> bool:
        with self._cond:
            return bool(self._groups)

    def stats(self) -> EngineStats:
        scheduled, prefills, tokens = self._last_step
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting) + len(self._new),
            kv=self.kv_cache_manager.usage(), max_num_seqs=self.config.max_num_seqs,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens, num_steps=self._num_steps, finished=dict(self._finished),
            last_step_num_scheduled=scheduled, last_step_num_prefills=prefills, last_step_num_tokens=tokens)

    # -- the loop -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the background loop thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run_loop, name="llm-engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still in flight end with finish_reason ``abort``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
        with self._cond:
            self._aborts.extend(self._groups)
        self._take_inbox()

    def _run_loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._new or self._aborts or self._live):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                if self.before_step is not None:
                    self.before_step()
                self.step()
            except Exception as exc:  # a bug must not kill the loop: fail what is in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(f"engine error: {exc}")

    # -- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling + forward + sampling step and delivers the deltas to the sinks.

        Returns:
            The deltas produced (also put on each request's sink).
        """
        outputs = self._take_inbox()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        self._num_steps += 1
        num_prefills = sum(1 for n in sched.num_scheduled_tokens if n > 1)
        self._last_step = (len(sched.requests), num_prefills, sched.total_num_scheduled_tokens)
        try:
            result = self.model_runner.execute(sched)
        except Exception as exc:
            log.exception("forward pass failed for %d requests", len(sched.requests))
            for request in sched.requests:
                if not request.is_finished:
                    outputs.extend(self._finish(request, RequestStatus.FINISHED_ERROR, f"forward pass failed: {exc}"))
            return outputs

        for request in self.scheduler.update_from_output(sched, result.sampled):
            live = self._live[request.request_id]
            if request.num_output_tokens == 1 and request.index == 0:
                self._prompt_tokens += request.num_prompt_tokens
            self._generation_tokens += 1
            token_id = request.token_ids[-1]
            live.detokenizer.add_token(token_id, check_stop=request.num_output_tokens > request.params.min_tokens)
            if live.detokenizer.stopped:
                self.scheduler.finish_on_stop_string(request)
            logprobs = result.logprobs.get(request.request_id)
            outputs.append(self._emit(live, [token_id], None if logprobs is None else [logprobs]))
        return outputs

    def _take_inbox(self) -> list[RequestOutput]:
        with self._cond:
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
        for live in new:
            self._live[live.request.request_id] = live
            if live.request.index == 0:  # the others start from it once the prompt is computed
                self.scheduler.add_request(live.request)
        outputs = []
        for request_id in aborts:
            for child_id in self._groups.get(request_id, ()):
                live = self._live.get(child_id)
                if live is not None and not live.request.is_finished:
                    outputs.extend(self._finish(live.request, RequestStatus.FINISHED_ABORTED))
        return outputs

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> list[RequestOutput]:
        """Ends a request and any completions still waiting to fork from it, emitting their last deltas."""
        ended = [request, *request.forks]
        self.scheduler.finish_request(request, status)
        outputs = []
        for r in ended:
            r.error = error
            outputs.append(self._emit(self._live[r.request_id], [], None))
        return outputs

    def _emit(self, live: _Live, token_ids: list[int], logprobs) -> RequestOutput:
        request = live.request
        finished = request.is_finished
        out = RequestOutput(live.parent_id, token_ids, live.detokenizer.delta(final=finished),
                            request.status.finish_reason, request.num_prompt_tokens, request.num_output_tokens,
                            logprobs, request.error, index=request.index,
                            num_cached_tokens=request.num_cached_tokens)
        if finished:
            out.metrics = RequestMetrics(request.arrival_time, request.first_token_time, request.finish_time,
                                         request.num_output_tokens)
            self._finished[out.finish_reason] += 1
            del self._live[request.request_id]
            live.unfinished[0] -= 1
            out.done = live.unfinished[0] == 0
            if out.done:
                with self._cond:
                    del self._groups[live.parent_id]
        live.sink.put(out)
        return out

    def _fail_all(self, error: str) -> None:
        for live in list(self._live.values()):
            if not live.request.is_finished:
                self._finish(live.request, RequestStatus.FINISHED_ERROR, error)

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
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt is empty")
            vocab = self.model_config.vocab_size
            for token_id in prompt:
                if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab:
                    raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {token_id!r}")
            return list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _blocks_from_memory(self, model) -> int:
        per_block = kv_bytes_per_block(model.config, self.config.block_size, next(model.parameters()).dtype)
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if model.device.type == "cuda":
                budget = int(torch.cuda.mem_get_info(model.device)[0] * GPU_KV_FRACTION)
            else:
                available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                budget = min(int(available * CPU_KV_FRACTION), CPU_KV_CAP_BYTES)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no block ({per_block} bytes each)")
        return num_blocks


def _cpu_kernels_available() -> bool:
    import kernels.cpu

    return kernels.cpu.load() is not None


def _eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    ids = set()
    generation_config = getattr(model, "generation_config", None)
    for value in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(value)
    return tuple(sorted(ids))
