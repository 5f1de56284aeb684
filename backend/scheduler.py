"""Iteration-level scheduling (Orca, Yu et al. OSDI 2022) with vLLM v1's single rule.

Every step each scheduled request's ``num_computed_tokens`` catches up with its tokens, under a token
budget (``max_num_batched_tokens``) and a sequence budget (``max_num_seqs``). Prefill, chunked prefill
and decode are the same code path: a decode is a request one token behind.

``schedule()`` returns a :class:`~backend.scheduler_output.SchedulerOutput` holding each request's block
table; ``update_from_output()`` applies the model runner's sampled tokens and the stopping rule
(``backend.stopping``). The scheduler asks the KV cache manager through its methods only.

Priorities follow vLLM's priority policy: a lower ``Request.priority`` waits ahead of a higher one (first
come, first served among equals), and preemption takes the running request with the highest value (the
newest among equals). A waiting request of a lower value than a running one preempts it when there is no
room for both. With every priority equal this is plain FCFS.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from backend.config import EngineConfig
from backend.kv_cache_manager import KVCacheManager
from backend.request import Request, RequestStatus
from backend.scheduler_output import ScheduledRequest, SchedulerOutput
from backend.stats import SchedulerStats
from backend.stopping import stop_status


class Scheduler:
    """Owns the waiting and running queues; decides each step who computes how many tokens."""

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()  # by priority, then first come first served
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_waiting_tokens = 0  # tokens of the waiting requests (all to be computed when admitted)

    # -- admission ---------------------------------------------------------------------------------
    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """Rejects a request that could never run, instead of letting it wait forever.

        Raises:
            ValueError: prompt + max_tokens over max_model_len, or more blocks than the whole pool.
        """
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                             f"max_model_len ({self.max_model_len})")
        blocks = self.kv.max_blocks_per_request(total, self.max_num_batched_tokens)
        if blocks > self.kv.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks ({total} tokens) but the whole KV cache has "
                             f"{self.kv.num_blocks} blocks of {self.kv.block_size} tokens")

    def add_request(self, request: Request) -> None:
        """Queues a request behind every waiting request of the same or a lower priority value."""
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, front: bool) -> None:
        """Into the waiting queue, kept sorted by priority: ahead of (``front``) or behind its equals."""
        find = bisect.bisect_left if front else bisect.bisect_right
        self.waiting.insert(find(self.waiting, request.priority, key=_priority), request)
        self.num_waiting_tokens += request.num_tokens

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)
        self.num_waiting_tokens -= request.num_tokens

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running requests first (oldest first), then waiting ones while both budgets allow.

        When a running request needs a block and none is free, the running request with the highest priority
        value (the newest among equals) is preempted (recompute: its blocks are freed and it goes back to the
        waiting queue, ahead of its equals); no waiting request is admitted in a step that preempted so.
        A waiting request that finds no free block or no free sequence slot preempts the running request with
        the highest priority value if that value is higher than its own (vLLM's priority policy); with every
        priority equal this never happens, and admission is plain FCFS.
        """
        token_budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False

        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while not self.kv.allocate_slots(request, num_new):
                victim_index = max(range(len(self.running)), key=lambda j: (self.running[j].priority, j))
                victim = self.running.pop(victim_index)
                if victim_index < i:  # already scheduled this step: give its tokens back
                    k = next(k for k, (r, _) in enumerate(scheduled) if r is victim)
                    token_budget += scheduled.pop(k)[1]
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                token_budget -= num_new
                i += 1

        while not preempted and self.waiting and token_budget > 0:
            request = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                if not self._preempt_for(request, scheduled):
                    break
                token_budget = self.max_num_batched_tokens - sum(n for _, n in scheduled)
                continue
            # New or preempted: it holds no blocks. Prompt logprobs need every prompt position's logits.
            cached = [] if request.wants_prompt_logprobs else self.kv.get_computed_blocks(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, token_budget)
            if not self.kv.allocate_slots(request, num_new, cached):
                if not self._preempt_for(request, scheduled):
                    break
                token_budget = self.max_num_batched_tokens - sum(n for _, n in scheduled)
                continue
            request.num_computed_tokens += num_cached
            if request.num_preemptions == 0 and request.num_output_tokens == 0:
                request.num_cached_tokens = num_cached
            self.waiting.popleft()
            self.num_waiting_tokens -= request.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            token_budget -= num_new

        scheduled.sort(key=lambda item: item[1] != 1)  # decodes first; stable within each group
        return SchedulerOutput([ScheduledRequest(request, request.num_computed_tokens, n,
                                                 self.kv.get_block_ids(request.request_id))
                                for request, n in scheduled])

    def _preempt_for(self, request: Request, scheduled: list[tuple[Request, int]]) -> bool:
        """Makes room for the waiting ``request`` by preempting the running request with the highest priority
        value (the newest among equals), if that value is higher than ``request``'s (vLLM's priority policy)
        and no request admitted this step took one of the blocks it fills this step as a prefix-cache hit;
        a victim scheduled earlier this step is taken out of ``scheduled``. Returns whether one was."""
        if not self.running:
            return False
        victim_index = max(range(len(self.running)), key=lambda j: (self.running[j].priority, j))
        victim = self.running[victim_index]
        # A victim whose blocks of this step a request admitted after it took as hits must compute them.
        if victim.priority <= request.priority or self.kv.shares_unwritten_blocks(victim):
            return False
        self.running.pop(victim_index)
        scheduled[:] = [(r, n) for r, n in scheduled if r is not victim]
        self._preempt(victim)
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    # -- after the forward pass --------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances ``num_computed_tokens``, appends sampled tokens (advancing the grammar of a request
        with structured outputs) and finishes requests that hit EOS, a stop token id, the end of their
        grammar or max_tokens (:func:`backend.stopping.stop_status`).

        Args:
            sampled: request id -> the token sampled for it (only requests that reached their last token).

        Returns:
            The requests that got a new token this step (finished ones included, blocks already freed).
        """
        now = time.monotonic()
        updated = []
        for s in out.scheduled:
            request = s.request
            if request.is_finished:  # ended by a shutdown on another thread while the step ran
                continue
            request.num_computed_tokens += s.num_scheduled_tokens
            token_id = sampled.get(request.request_id)
            if token_id is None:
                continue  # a prefill chunk that has not reached the end of the prompt
            request.append_token(token_id, now)
            updated.append(request)
            if request.grammar is not None and not request.grammar.accept(token_id):
                self.finish_request(request, RequestStatus.FINISHED_ERROR,
                                    f"token {token_id} was sampled outside the request's grammar")
                continue
            reason = stop_status(request, token_id)
            if reason is not None:
                self.finish_request(request, reason)
        return updated

    def finish_on_stop_string(self, request: Request) -> None:
        """The detokenizer found a stop string ending in the request's last token (after
        ``update_from_output``, which cannot see text): finish the request, or, when that same token also
        reached max_tokens and finished it as ``length``, relabel it ``stop`` (its blocks are already free).
        The decision is :func:`~backend.stopping.stop_status`'s, as for EOS and stop token ids."""
        status = stop_status(request, request.token_ids[-1], stop_string_matched=True)
        if status is None:
            return
        if not request.is_finished:
            self.finish_request(request, status)
        elif request.status == RequestStatus.FINISHED_LENGTH:
            request.status = status

    def finish_request(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Ends a request (any finished status) and frees its blocks at once; idempotent.

        Args:
            error: why it failed (``FINISHED_ERROR``); its blocks' prefix-cache entries are dropped too,
                since the failed step may not have written them.
        """
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self._dequeue(request)
            except ValueError:
                pass
        request.status = status
        request.error = error
        request.finish_time = time.monotonic()
        self.kv.free(request, uncache=status == RequestStatus.FINISHED_ERROR)

    def make_stats(self) -> SchedulerStats:
        """A snapshot of the queues and the KV pool (for the engine's stats; taken on the engine thread)."""
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              num_preemptions=self.num_preemptions,
                              num_computed_tokens=sum(r.num_computed_tokens for r in self.running),
                              kv=self.kv.usage())


def _priority(request: Request) -> int:
    return request.priority
