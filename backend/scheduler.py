"""Iteration-level scheduling (Orca, Yu et al. OSDI 2022) with vLLM v1's single rule.

Every step each scheduled request's ``num_computed_tokens`` catches up with its tokens, under a token
budget (``max_num_batched_tokens``) and a sequence budget (``max_num_seqs``). Prefill, chunked prefill
and decode are the same code path: a decode is a request one token behind.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from backend.config import EngineConfig
from backend.kv_cache_manager import KVCacheManager
from backend.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What to compute this step.

    ``requests[i]`` computes ``num_scheduled_tokens[i]`` tokens starting at its ``num_computed_tokens``.
    Decodes (one token) come first, then prefill chunks, so the model runner can batch the decodes.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    """Owns the waiting and running queues; decides each step who computes how many tokens."""

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

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
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running requests first (oldest first), then waiting ones while both budgets allow.

        When a running request needs a block and none is free, the newest running request is preempted
        (recompute: its blocks are freed and it goes back to the front of the waiting queue).
        """
        out = SchedulerOutput()
        token_budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                token_budget -= num_new
                i += 1

        if not out.preempted:
            while self.waiting and len(self.running) < self.max_num_seqs and token_budget > 0:
                request = self.waiting[0]
                cached = []
                if request.request_id not in self.kv.block_tables:  # new or preempted: try the prefix cache
                    cached = self.kv.get_computed_blocks(request)
                num_cached = len(cached) * self.kv.block_size
                num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, token_budget)
                if not self.kv.allocate_slots(request, num_new, cached):
                    break
                request.num_computed_tokens += num_cached
                if request.num_preemptions == 0 and request.num_output_tokens == 0:
                    request.num_cached_tokens = num_cached
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled.append((request, num_new))
                token_budget -= num_new

        scheduled.sort(key=lambda item: item[1] != 1)  # decodes first; stable within each group
        out.requests = [request for request, _ in scheduled]
        out.num_scheduled_tokens = [n for _, n in scheduled]
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the forward pass --------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances ``num_computed_tokens``, appends sampled tokens and finishes requests that hit
        EOS, a stop token id or max_tokens.

        Args:
            sampled: request id -> the token sampled for it (only requests that reached their last token).

        Returns:
            The requests that got a new token this step (finished ones included, blocks already freed).
        """
        now = time.monotonic()
        updated = []
        for request, num_new in zip(out.requests, out.num_scheduled_tokens):
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += num_new
            self.kv.cache_full_blocks(request)
            if request.forks and request.num_computed_tokens >= request.num_prompt_tokens:
                self._start_forks(request)
            token_id = sampled.get(request.request_id)
            if token_id is None:
                continue  # a prefill chunk that has not reached the end of the prompt
            request.append_token(token_id, now)
            updated.append(request)
            reason = stop_status(request, token_id)
            if reason is not None:
                self.finish_request(request, reason)
        return updated

    def _start_forks(self, request: Request) -> None:
        """Parallel sampling: the other completions share the now computed prompt blocks and recompute only
        the last prompt token, for logits of their own (its block is copied on write)."""
        for child in request.forks:
            if child.is_finished:  # aborted before it could start
                continue
            self.kv.fork(request, child, request.num_prompt_tokens)
            child.num_computed_tokens = request.num_prompt_tokens - 1
            self.waiting.appendleft(child)
        request.forks = []

    def finish_on_stop_string(self, request: Request) -> None:
        """The detokenizer found a stop string ending in the request's last token (after
        ``update_from_output``, which cannot see text): finish the request, or, when that same token also
        reached max_tokens and finished it as ``length``, relabel it ``stop`` (its blocks are already free).
        The decision is :func:`stop_status`'s, as for EOS and stop token ids."""
        status = stop_status(request, request.token_ids[-1], stop_string_matched=True)
        if status is None:
            return
        if not request.is_finished:
            self.finish_request(request, status)
        elif request.status == RequestStatus.FINISHED_LENGTH:
            request.status = status

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Ends a request (any finished status) and frees its blocks at once; idempotent."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        request.finish_time = time.monotonic()
        self.kv.free(request)
        for child in request.forks:  # never started: they end with their parent
            self.finish_request(child, status)


def stop_status(request: Request, token_id: int, stop_string_matched: bool = False) -> RequestStatus | None:
    """Whether the token just appended ends the request, and why: the one stopping rule.

    vLLM's order: EOS (unless ``ignore_eos``) and ``stop_token_ids``, then a stop string completed by this
    token, then ``max_tokens``. So a last allowed token that is EOS, a stop token or the end of a stop
    string finishes with ``stop``, not ``length``. Within ``min_tokens`` only ``max_tokens`` can end it.

    Args:
        token_id: the token appended last (already in ``request.token_ids``).
        stop_string_matched: the detokenizer found a stop string ending in this token.

    Returns:
        ``FINISHED_STOPPED``, ``FINISHED_LENGTH`` or None (keep going).
    """
    params = request.params
    if request.num_output_tokens > params.min_tokens:
        if (token_id in request.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if stop_string_matched:
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
