"""The engine core (vLLM v1's ``EngineCore``): inbox -> schedule -> execute -> update, on engine requests.

It knows no text, sinks or caller ids: it takes :class:`Request` objects and aborts (thread-safe inbox),
runs ``Scheduler.schedule()`` -> ``ModelRunner.execute()`` -> ``Scheduler.update_from_output()`` and
returns which requests gained a token or ended (:class:`EngineCoreOutput`). The output processor turns
those into deltas.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from backend.config import EngineConfig
from backend.cpu_threads import plan_binding
from backend.kv_cache_manager import KVCacheManager
from backend.model_runner import ModelRunner
from backend.request import Request, RequestStatus
from backend.sampler import TokenLogprobs
from backend.scheduler import Scheduler
from backend.scheduler_output import SchedulerOutput
from backend.stats import SchedulerStats

log = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """What one step changed.

    Attributes:
        new_token: requests that got a token (finished ones included).
        ended: requests that ended without a token (aborted, or failed with ``error`` set).
        logprobs: request id -> logprobs of its new token, for requests that asked.
        sched: what was scheduled (None when the step only took its inbox).
    """

    new_token: list[Request] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    sched: SchedulerOutput | None = None


class EngineCore:
    """Owns the KV cache manager, the scheduler and the model runner; steps them.

    ``add_requests``, ``abort_requests``, ``wait_for_work`` and ``wake`` may be called from any thread;
    everything else from the one thread that steps.
    """

    def __init__(self, config: EngineConfig, model, max_model_len: int, num_blocks: int, use_kernels: bool,
                 cpu_kernel: bool, sliding_window: int | None = None) -> None:
        """``sliding_window``: the window every layer of the model attends through, if any (the KV cache
        manager then frees the blocks behind it)."""
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                               sliding_window=sliding_window)
        self.scheduler = Scheduler(config, self.kv_cache_manager, max_model_len)
        cpu_threads = None
        if cpu_kernel:  # pinning goes through the CPU kernels' extension
            cpu_threads = plan_binding(config.cpu_threads_bind, torch.get_num_threads())
        self.model_runner = ModelRunner(model, num_blocks, config.block_size, use_kernels, max_model_len,
                                        compact=config.model_impl == "auto", cpu_kernel=cpu_kernel,
                                        cpu_threads=cpu_threads)
        self._cond = threading.Condition()
        self._new: list[Request] = []
        self._aborts: list[str] = []
        self._woken = False
        self._requests: dict[str, Request] = {}  # unfinished requests taken from the inbox, by id

    # -- inbox (any thread) -------------------------------------------------------------------------
    def add_requests(self, requests: list[Request]) -> None:
        with self._cond:
            self._new.extend(requests)
            self._cond.notify()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Aborted at the next step (before it schedules); unknown or finished ids are ignored."""
        with self._cond:
            self._aborts.extend(request_ids)
            self._cond.notify()

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
        for request in new:
            self._requests[request.request_id] = request
            self.scheduler.add_request(request)
        ended = []
        for request_id in aborts:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
                ended.append(request)
        return ended

    def step(self) -> EngineCoreOutput:
        """Takes the inbox, then one scheduling + forward + sampling step.

        A failed forward pass ends the step's requests with ``FINISHED_ERROR`` (in ``ended``); others go on.
        """
        out = EngineCoreOutput(ended=self.take_inbox())
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return out
        out.sched = sched
        try:
            result = self.model_runner.execute(sched)
        except Exception as exc:
            log.exception("forward pass failed for %d requests", len(sched.scheduled))
            for request in sched.requests:
                if not request.is_finished:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, f"forward pass failed: {exc}")
                    out.ended.append(self._requests.pop(request.request_id))
            return out
        out.new_token = self.scheduler.update_from_output(sched, result.sampled)
        out.logprobs = result.logprobs
        for request in out.new_token:
            if request.is_finished:
                del self._requests[request.request_id]
        return out

    def finish_on_stop_strings(self, requests: list[Request]) -> None:
        """Ends the requests whose text reached a stop string (found by the output processor this step)."""
        for request in requests:
            self.scheduler.finish_on_stop_string(request)
            if request.is_finished:
                self._requests.pop(request.request_id, None)

    def fail_all(self, error: str) -> list[Request]:
        """Ends every request, queued or not yet taken, with ``FINISHED_ERROR``; returns them."""
        ended = self.take_inbox()
        failed = list(self._requests.values())
        self._requests.clear()
        for request in failed:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, error)
        return ended + failed

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()
