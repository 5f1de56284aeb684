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
    """

    num_running: int
    num_waiting: int
    num_preemptions: int
    num_computed_tokens: int
    kv: KVCacheUsage


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
    time: float = 0.0
