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
room for both.

Among equal priorities, waiting requests are admitted by start-time fair queuing (Goyal, Vin and Cheng,
SIGCOMM 1996) over their ``fairness_key`` (the client request they belong to: a multi-prompt completion's
prompts, an ``n`` > 1 request's completions, or whatever key a caller passes): each request's start tag is
``max(V, the previous tag of its key + 1)``, where V is the tag of the last request admitted, and the queue is
kept in tag order (first come, first served among equal tags). A request of a new key is therefore admitted
ahead of the remaining prompts of a 256-prompt request that arrived before it; with every key distinct (one
request each) this is plain FCFS.

With a step time budget (``max_step_ms``; Sarathi-Serve's token budget from a latency target, Agrawal et al.
OSDI 2024, sec. 4.3), while requests of more than one fairness key are running or waiting (a lone request's
prefill runs in full steps: there is nobody to keep waiting), prefill work (new requests and chunks of long
prompts) enters a step only up to what :class:`~backend.step_cost.StepCost`, fitted on the steps run so far, says
fits beside the step's decodes, and at least ``block_size`` tokens of it. While requests wait and a seat is free,
running prompts' chunks take at most half of that (and of ``max_num_batched_tokens``), at least ``block_size``
tokens: a waiting request is admitted beside a long prompt's chunks, not after them (at the floor such a step holds
twice the floor); what it does not finish then continues in turn, the running prompts first come, first served.
Decodes are never held back by it (``max_num_seqs`` bounds them).

Speculative decoding (``num_speculative_tokens`` k > 0): a running request one token behind that
:func:`~backend.ngram_proposer.can_speculate` allows gets up to k draft tokens from the n-gram proposer, and
computes its last token and the drafts in one step (1 + drafts tokens of the budget and of KV slots; no room for
the drafts: a plain decode). ``update_from_output`` appends the verified tokens one by one through the stopping
rule, advances ``num_computed_tokens`` past the last token and the accepted drafts only (the rejected drafts'
slots are written again later), and frees the blocks that only rejected drafts had needed. Drafts are never
hashed into the prefix cache: the KV cache manager registers only blocks full of the request's own tokens.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque

from backend.config import EngineConfig
from backend.kv_cache_manager import KVCacheManager
from backend.ngram_proposer import NgramProposer, can_speculate
from backend.request import Request, RequestStatus
from backend.scheduler_output import ScheduledRequest, SchedulerOutput, is_decode
from backend.stats import SchedulerStats
from backend.step_cost import DECAY, StepCost
from backend.stopping import stop_status

log = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting and running queues; decides each step who computes how many tokens."""

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()  # by priority, then start tag (fair queuing), then arrival
        self._virtual_time = 0  # start tag of the last request admitted
        self._next_tag: dict[str, int] = {}  # fairness key with waiting requests -> start tag of its next one
        self._num_waiting_by_key: dict[str, int] = {}
        self.max_step_s = config.max_step_ms / 1000 if config.max_step_ms else None
        self.step_cost = StepCost() if self.max_step_s else None
        self.min_prefill_tokens = config.block_size  # prefill tokens a step always admits under max_step_ms
        self._warned_prefill_floor = False  # whether the log has said that max_step_ms holds prefill to its floor
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_waiting_tokens = 0  # tokens of the waiting requests (all to be computed when admitted)
        self.proposer = None  # drafts for speculative decoding; None: off
        if config.num_speculative_tokens:
            self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                          config.prompt_lookup_max)
        self._drafts: dict[str, list[int]] = {}  # this step's drafts, by request id
        self.num_spec_drafts = 0  # speculative decodes verified since start (vLLM's spec_decode_num_drafts)
        self.num_spec_draft_tokens = 0  # draft tokens verified since start
        self.num_spec_accepted_tokens = 0  # of which accepted

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
        """Queues a request by priority, then by its start tag: behind every waiting request of a lower
        priority value, or of the same one and a start tag not above its own."""
        key = request.fairness_key
        # A key with nothing waiting starts afresh at V (only backlogged keys need a tag to remember).
        request.fair_start = max(self._virtual_time, self._next_tag.get(key, 0))
        self._next_tag[key] = request.fair_start + 1
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, front: bool) -> None:
        """Into the waiting queue, kept sorted by (priority, start tag): ahead of (``front``) or behind its
        equals."""
        find = bisect.bisect_left if front else bisect.bisect_right
        self.waiting.insert(find(self.waiting, _order(request), key=_order), request)
        self.num_waiting_tokens += request.num_tokens
        key = request.fairness_key
        self._num_waiting_by_key[key] = self._num_waiting_by_key.get(key, 0) + 1

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)
        self._left_waiting(request)

    def _left_waiting(self, request: Request) -> None:
        self.num_waiting_tokens -= request.num_tokens
        key = request.fairness_key
        left = self._num_waiting_by_key[key] - 1
        if left:
            self._num_waiting_by_key[key] = left
        else:  # the key's backlog is gone, and with it its tag
            del self._num_waiting_by_key[key]
            self._next_tag.pop(key, None)

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
        prefill_budget = self._prefill_budget()  # work units: prefill tokens, plus one per request
        # Under a budget, while requests wait and a seat is free, running prompts' chunks take at most half of the
        # prefill budget and of the step's tokens (at least the floor each): a waiting request is admitted beside a
        # long prompt's chunks, not after them (at the floor such a step holds twice the floor).
        floor = self.min_prefill_tokens + 1
        share = bool(self.waiting) and len(self.running) < self.max_num_seqs and prefill_budget != float("inf")
        reserve = max(floor, int(prefill_budget) // 2) if share else 0
        running_prefill = max(prefill_budget - reserve, floor) if share else prefill_budget
        token_reserve = min(reserve - 1, self.max_num_batched_tokens // 2) if share else 0
        charged: dict[str, int] = {}  # prefill units taken by each request scheduled this step
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        if self._drafts:
            self._drafts = {}

        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            if num_new > 1:  # a long prompt's next chunk: prefill work
                num_new = min(num_new, running_prefill - 1,
                              max(token_budget - token_reserve, self.min_prefill_tokens))
                if num_new <= 0:
                    i += 1
                    continue
                charged[request.request_id] = num_new + 1
                prefill_budget -= num_new + 1
                running_prefill -= num_new + 1
            if self.proposer is not None and request.num_tokens - request.num_computed_tokens == 1:
                drafts = self._propose(request, token_budget)
                if drafts and self.kv.allocate_slots(request, 1 + len(drafts)):
                    self._drafts[request.request_id] = drafts
                    scheduled.append((request, 1 + len(drafts)))
                    token_budget -= 1 + len(drafts)
                    i += 1
                    continue
            while not self.kv.allocate_slots(request, num_new):
                victim_index = max(range(len(self.running)), key=lambda j: (self.running[j].priority, j))
                victim = self.running.pop(victim_index)
                returned = charged.pop(victim.request_id, 0)
                prefill_budget += returned
                running_prefill += returned
                if victim_index < i:  # passed already: give its tokens back (none if the budget skipped it)
                    k = next((k for k, (r, _) in enumerate(scheduled) if r is victim), None)
                    if k is not None:
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

        prefill_budget = max(prefill_budget, reserve)
        while not preempted and self.waiting and token_budget > 0:
            request = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                victim = self._preempt_for(request, scheduled)
                if victim is None:
                    break
                prefill_budget += charged.pop(victim.request_id, 0)
                token_budget = self.max_num_batched_tokens - sum(n for _, n in scheduled)
                continue
            # New or preempted: it holds no blocks. Prompt logprobs need every prompt position's logits.
            cached = [] if request.wants_prompt_logprobs else self.kv.get_computed_blocks(request)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(request.num_tokens - request.num_computed_tokens - num_cached, token_budget,
                          prefill_budget - 1)
            if num_new <= 0:
                break
            if not self.kv.allocate_slots(request, num_new, cached):
                victim = self._preempt_for(request, scheduled)
                if victim is None:
                    break
                prefill_budget += charged.pop(victim.request_id, 0)
                token_budget = self.max_num_batched_tokens - sum(n for _, n in scheduled)
                continue
            request.num_computed_tokens += num_cached
            if request.num_preemptions == 0 and request.num_output_tokens == 0:
                request.num_cached_tokens = num_cached
            if not request.wants_prompt_logprobs:  # those read nothing from the cache
                self.kv.record_prefix_lookup(request, num_cached)
            self.waiting.popleft()
            self._left_waiting(request)
            self._virtual_time = max(self._virtual_time, request.fair_start)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            token_budget -= num_new
            charged[request.request_id] = num_new + 1
            prefill_budget -= num_new + 1

        scheduled.sort(key=lambda item: not is_decode(*item))  # decodes first; stable within each group
        num_decodes = sum(1 for item in scheduled if is_decode(*item))
        if self._drafts:
            drafts = self._drafts
            return SchedulerOutput([ScheduledRequest(request, request.num_computed_tokens, n,
                                                     self.kv.get_block_ids(request.request_id),
                                                     drafts.get(request.request_id, ()))
                                    for request, n in scheduled], sum(len(d) for d in drafts.values()), num_decodes)
        return SchedulerOutput([ScheduledRequest(request, request.num_computed_tokens, n,
                                                 self.kv.get_block_ids(request.request_id))
                                for request, n in scheduled], num_decodes=num_decodes)

    def _prefill_budget(self) -> int | float:
        """Work units (prefill tokens, plus one per request that samples) this step may spend on prefill:
        unbounded without ``max_step_ms``, before the first step has been timed, or while every running and
        waiting request has one fairness key (nobody else to keep waiting: a lone long prompt runs in full
        steps); else what the step cost fit says fits in ``max_step_ms`` beside the running decodes (two
        units each), at least ``min_prefill_tokens`` + 1 so that waiting requests always move."""
        if self.step_cost is None or not self._shared():
            return float("inf")
        num_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        units = self.step_cost.units_within(self.max_step_s, 2 * num_decodes)
        if units is None:
            return float("inf")
        # Said once the fit has a window of steps behind it (a cold first step would say so at start-up).
        if (units <= self.min_prefill_tokens and not self._warned_prefill_floor
                and self.step_cost.num_steps >= round(1 / (1 - DECAY))):
            self._warned_prefill_floor = True
            base, per_unit = self.step_cost.line()
            log.warning("max_step_ms %g leaves prefill %d tokens a step: a step with %d running decode%s takes about "
                        "%.0f ms here and each prompt token adds about %.2f ms (the engine's fit of step time), so "
                        "time to first token grows with the load; about three times the decode step at the expected "
                        "number of streams bounds their gaps without holding prefill back (docs/configuration.md, "
                        "step time budget)", self.max_step_s * 1000, self.min_prefill_tokens, num_decodes,
                        "" if num_decodes == 1 else "s", (base + per_unit * 2 * num_decodes) * 1000, per_unit * 1000)
        return max(units, self.min_prefill_tokens + 1)

    def _shared(self) -> bool:
        """Whether the running and waiting requests have more than one fairness key between them."""
        key = None
        for queue in (self.running, self.waiting):
            for request in queue:
                if key is None:
                    key = request.fairness_key
                elif request.fairness_key != key:
                    return True
        return False

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The step that ran ``out`` took ``seconds`` (schedule to update): feeds the step cost fit."""
        if self.step_cost is not None:
            self.step_cost.observe(out.total_num_scheduled_tokens + len(out.scheduled), seconds)

    def _propose(self, request: Request, token_budget: int) -> list[int]:
        """Drafts for a running request one token behind: none unless it may speculate; at most what the
        token budget leaves beside its last token, and fewer than the output tokens it may still produce (the
        step always adds one token of the model's own besides the accepted drafts)."""
        if not can_speculate(request):
            return []
        room = min(token_budget - 1, request.max_tokens - request.num_output_tokens - 1)
        return self.proposer.propose(request.token_ids, room) if room > 0 else []

    def _preempt_for(self, request: Request, scheduled: list[tuple[Request, int]]) -> Request | None:
        """Makes room for the waiting ``request`` by preempting the running request with the highest priority
        value (the newest among equals), if that value is higher than ``request``'s (vLLM's priority policy)
        and no request admitted this step took one of the blocks it fills this step as a prefix-cache hit;
        a victim scheduled earlier this step is taken out of ``scheduled``. Returns the victim, or None."""
        if not self.running:
            return None
        victim_index = max(range(len(self.running)), key=lambda j: (self.running[j].priority, j))
        victim = self.running[victim_index]
        # A victim whose blocks of this step a request admitted after it took as hits must compute them.
        if victim.priority <= request.priority or self.kv.shares_unwritten_blocks(victim):
            return None
        self.running.pop(victim_index)
        scheduled[:] = [(r, n) for r, n in scheduled if r is not victim]
        self._preempt(victim)
        return victim

    def _preempt(self, request: Request) -> None:
        self._drafts.pop(request.request_id, None)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    # -- after the forward pass --------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           verified: dict[str, list[int]] | None = None) -> list[Request]:
        """Advances ``num_computed_tokens``, appends sampled tokens (advancing the grammar of a request
        with structured outputs) and finishes requests that hit EOS, a stop token id, the end of their
        grammar or max_tokens (:func:`backend.stopping.stop_status`).

        Args:
            sampled: request id -> the token sampled for it (only requests that reached their last token).
            verified: request id -> a speculative decode's tokens: its accepted drafts, then the model's token
                after them (1 to 1 + drafts tokens); for every scheduled request with drafts.

        Returns:
            The requests that got one or more new tokens this step (finished ones included, blocks already freed).
        """
        now = time.monotonic()
        updated = []
        for s in out.scheduled:
            request = s.request
            if request.is_finished:  # ended by a shutdown on another thread while the step ran
                continue
            if s.draft_token_ids:
                self._apply_verified(request, len(s.draft_token_ids), verified[request.request_id], now)
                updated.append(request)
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

    def _apply_verified(self, request: Request, num_drafts: int, tokens: list[int], now: float) -> None:
        """A speculative decode's result: ``tokens`` (accepted drafts + the model's next token) appended one by
        one through the stopping rule, none after the one that ends the request. The last token and the
        accepted drafts now have their K/V; the rejected drafts' slots are past ``num_computed_tokens`` and are
        written again later, and the blocks only they needed go back to the pool."""
        num_accepted = len(tokens) - 1
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_drafts
        self.num_spec_accepted_tokens += num_accepted
        computed = request.num_computed_tokens + 1 + num_accepted
        reason = None
        for token_id in tokens:
            request.append_token(token_id, now)
            reason = stop_status(request, token_id)
            if reason is not None:
                break
        request.num_computed_tokens = min(computed, request.num_tokens - 1)
        if reason is not None:
            self.finish_request(request, reason)
        else:
            self.kv.free_surplus_blocks(request)

    def finish_on_stop_string(self, request: Request, num_output_tokens: int | None = None) -> None:
        """The detokenizer found a stop string ending in the request's last token (after
        ``update_from_output``, which cannot see text): finish the request, or, when that same token also
        reached max_tokens and finished it as ``length``, relabel it ``stop`` (its blocks are already free).
        The decision is :func:`~backend.stopping.stop_status`'s, as for EOS and stop token ids.

        Args:
            num_output_tokens: the stop string ends in this output token, before the last one (a speculative
                decode appended several): the tokens after it are dropped first. None: the last token.
        """
        if num_output_tokens is not None and num_output_tokens < request.num_output_tokens:
            del request.token_ids[request.num_prompt_tokens + num_output_tokens:]
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
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
                              kv=self.kv.usage(), spec_decode_num_drafts=self.num_spec_drafts,
                              spec_decode_num_draft_tokens=self.num_spec_draft_tokens,
                              spec_decode_num_accepted_tokens=self.num_spec_accepted_tokens)


def _order(request: Request) -> tuple[int, int]:
    return request.priority, request.fair_start
