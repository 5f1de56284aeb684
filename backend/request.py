"""A request's state as it moves through the engine (vLLM v1's Request / RequestStatus)."""

from __future__ import annotations

import enum
import time

import torch

from backend.sampling_params import SamplingParams, generator_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"
    FINISHED_TIMEOUT = "timeout"

    @property
    def is_finished(self) -> bool:
        return self._value_ in FINISH_REASONS  # not self.name / self.value: enum descriptors, slow in a hot loop

    @property
    def finish_reason(self) -> str | None:
        """``stop``, ``length``, ``abort``, ``error`` or ``timeout`` once finished, else None."""
        return self._value_ if self._value_ in FINISH_REASONS else None


FINISH_REASONS = frozenset(s.value for s in RequestStatus if s.name.startswith("FINISHED_"))


class Request:
    """One prompt and its output so far.

    ``token_ids`` holds the prompt followed by the sampled tokens. Each step the scheduler lets
    ``num_computed_tokens`` (tokens whose K/V are in the cache) catch up with ``len(token_ids)``:
    a prefill is many tokens at once, a decode is the one token sampled last step (vLLM v1's single rule).
    Preemption by recompute resets ``num_computed_tokens`` to 0 and keeps the tokens.

    The scheduler advances its counters and status; the KV cache manager only reads it; the output
    processor reads its tokens and status to build deltas. A request is one completion: an ``n`` > 1
    request is ``n`` of them (``index`` 0..n-1), fanned out and in by ``backend.parallel_sampling``.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int, index: int = 0,
                 bad_words_token_ids: list[list[int]] | None = None, cache_salt: str | None = None,
                 priority: int = 0, timeout: float | None = None, grammar=None,
                 fairness_key: str | None = None) -> None:
        """``priority``: lower is scheduled first (vLLM's priority policy); ``timeout``: seconds from now after
        which the request ends with finish_reason ``timeout`` (None: no deadline); ``grammar``: this
        completion's :class:`~backend.structured_output.Grammar` when its output is constrained;
        ``fairness_key``: requests with the same key share one turn in admission (the scheduler's fair
        queuing); None: the request's own id."""
        self.request_id = request_id
        self.index = index  # which of the prompt's n completions (parallel sampling)
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        self.bad_words_token_ids = bad_words_token_ids or []  # params.bad_words, tokenized (backend.bad_words)
        self.grammar = grammar  # advanced with each appended token (Scheduler.update_from_output)
        self.cache_salt = cache_salt  # prefix-cache sharing limited to requests with the same salt
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.error: str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(generator_seed(params.seed + index))
        # Timestamps (time.monotonic seconds) for TTFT / TPOT / end-to-end latency.
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.priority = priority
        self.fairness_key = request_id if fairness_key is None else fairness_key
        self.fair_start = 0  # start tag in the waiting queue (set by Scheduler.add_request)
        self.deadline = None if timeout is None else self.arrival_time + timeout  # time.monotonic seconds

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The prompt's logprobs are computed for this completion: ``prompt_logprobs`` was asked for, and it is
        the first of the prompt's ``n`` completions (the others would compute the same values)."""
        return self.params.prompt_logprobs is not None and self.index == 0

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")
