"""What the engine streams back: one delta per completion per step (built by ``backend.output_processor``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from backend.sampler import TokenLogprobs


@dataclass
class RequestMetrics:
    """Timings of a finished request, in seconds (``time.monotonic``)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float
    num_output_tokens: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first (TPOT); None with fewer than two tokens."""
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    """A delta: what one request gained in one step.

    Attributes:
        token_ids: the tokens sampled since the last delta.
        text: their text (minus any tail held back as a possible stop string).
        finish_reason: ``stop``, ``length``, ``abort``, ``error`` or ``timeout`` on the last delta, else None.
        num_prompt_tokens / num_output_tokens: totals so far.
        logprobs: per new token, when the request asked for logprobs.
        error: why the request failed, with finish_reason ``error``.
        metrics: timings, on the last delta.
        index: which completion of an ``n`` > 1 request this delta belongs to.
        done: True on the very last delta of the request (all of its completions finished).
        num_cached_tokens: prompt tokens served from the prefix cache at first admission (for the completions
            of an ``n`` > 1 request, blocks shared with the other completions count too).
        prompt_logprobs: with ``prompt_logprobs`` asked for, on completion 0's first delta: one entry per prompt
            token, None for the first (nothing precedes it), else its :class:`TokenLogprobs`.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    index: int = 0
    done: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def coalesce(deltas: list[RequestOutput]) -> list[RequestOutput]:
    """Merges the deltas of each completion in ``deltas`` (in the order they were produced) into one, for a
    consumer that fell behind the engine: tokens, text and logprobs concatenated, everything else (finish
    reason, counts, metrics, ``done``) from the latest. vLLM v1 merges queued deltas the same way when the
    consumer is behind (``RequestOutputCollector``).

    A delta with finish_reason ``error`` is never merged into (the tokens before it are sent before the
    error). The result is ordered by each merged delta's latest part, so a request's ``done`` delta stays
    after its other completions' deltas.

    Returns:
        New :class:`RequestOutput` objects where merged; the inputs are not modified.
    """
    merged: dict[tuple, RequestOutput] = {}
    for out in deltas:
        key = (out.request_id, out.index)
        earlier = merged.pop(key, None)
        if earlier is not None and out.finish_reason == "error":
            merged[key] = earlier
            key = (*key, "error")
        elif earlier is not None:
            logprobs = None if earlier.logprobs is None and out.logprobs is None else [
                *(earlier.logprobs or []), *(out.logprobs or [])]
            out = replace(out, token_ids=earlier.token_ids + out.token_ids, text=earlier.text + out.text,
                          logprobs=logprobs, prompt_logprobs=earlier.prompt_logprobs or out.prompt_logprobs)
        merged[key] = out  # (re)inserted last: dicts keep insertion order
    return list(merged.values())
