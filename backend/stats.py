"""Snapshots for metrics and benchmarks, taken on the engine thread after each step and read from any thread."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.kv_cache_manager import KVCacheUsage


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queues and the KV pool after a step (vLLM v1's ``SchedulerStats``).

    Attributes:
        num_running / num_waiting: requests in each queue.
        num_preemptions: total since start.
        num_computed_tokens: tokens whose K/V are cached, summed over the running requests.
        kv: the pool's usage.
        spec_decode_num_drafts / spec_decode_num_draft_tokens / spec_decode_num_accepted_tokens: speculative
            decodes verified, draft tokens in them, and drafts accepted, totals since start (vLLM's names).
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    num_computed_tokens: int
    kv: KVCacheUsage
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


@dataclass
class EngineStats:
    """A snapshot for metrics. Counters are totals since start; ``last_step_*`` describe the latest step.

    Attributes:
        num_running / num_waiting: requests running, and waiting (in the scheduler or not yet taken in).
        kv: the KV pool's usage.
        num_computed_tokens: tokens with K/V in the cache, over the running requests (blocks used times
            block size minus this is what paging wastes).
        prompt_tokens / generation_tokens: tokens computed for prompts (counted once per prompt, at its
            first output token) and tokens generated.
        finished: finish reason -> requests (completions) finished.
        num_rejected: requests refused since start because the waiting queue was full.
        spec_decode_num_drafts: speculative decodes (a request's step with draft tokens) since start.
        spec_decode_num_draft_tokens: draft tokens proposed and verified since start.
        spec_decode_num_accepted_tokens: of which accepted (each saved one step of that request); the
            acceptance rate is this over ``spec_decode_num_draft_tokens``.
        time: ``time.perf_counter()`` when the snapshot was taken, in seconds.
    """

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
    num_computed_tokens: int = 0
    num_rejected: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    time: float = 0.0
