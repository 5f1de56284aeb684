"""Fan-in of a request's completions on the answering side: deltas gathered per completion, handed out in
index order.

The engine fans a request with ``n`` > 1 out into ``n`` completions (``backend.parallel_sampling``) and
streams their deltas interleaved, marking the request's very last delta ``done``. Whoever answers a caller
gathers them with :class:`FanIn`: the Triton model for a non-streaming response (one response holding every
completion, and the cumulative log-probability of each while streaming), the OpenAI frontend for its
``choices`` (keyed by prompt and completion when a request has several prompts). One rule for both: a
completion's text and tokens are its deltas' in arrival order, its finish reason and counts are its latest
delta's, and completions are answered in index order.

A delta is anything with the attributes of :class:`backend.outputs.RequestOutput` that are read here
(``index``, ``text``, ``token_ids``, ``finish_reason``, ``num_output_tokens``, ``logprobs``,
``prompt_logprobs``): the engine's own deltas and the frontend's ``Delta`` (what the Triton model sent).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    """One completion's deltas, gathered.

    Attributes:
        index: the key it was gathered under (its completion index unless the caller chose another).
        text: its deltas' text pieces, in arrival order.
        token_ids: its tokens so far.
        logprobs: per token, as the deltas carry them (engine: ``TokenLogprobs``; frontend: vLLM's dicts).
        prompt_logprobs: its prompt's logprobs, from the delta that carried them (None until then).
        finish_reason: the latest delta's (None while it runs).
        num_output_tokens: the latest delta's total.
        last: the latest delta.
    """

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: object | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    last: object | None = None

    @property
    def joined_text(self) -> str:
        return "".join(self.text)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class FanIn:
    """The completions of one request (or of one caller's several prompts), gathered from their deltas."""

    def __init__(self) -> None:
        self.completions: dict[int, Completion] = {}

    def add(self, delta, index: int | None = None) -> Completion:
        """Gathers ``delta`` under ``index`` (default ``delta.index``); returns that completion."""
        key = delta.index if index is None else index
        completion = self.completions.get(key)
        if completion is None:
            completion = self.completions[key] = Completion(key)
        completion.text.append(delta.text)
        completion.token_ids.extend(delta.token_ids)
        completion.logprobs.extend(delta.logprobs or [])
        if delta.prompt_logprobs is not None:
            completion.prompt_logprobs = delta.prompt_logprobs
        completion.finish_reason = delta.finish_reason or completion.finish_reason
        completion.num_output_tokens = delta.num_output_tokens
        completion.last = delta
        return completion

    def in_order(self) -> list[Completion]:
        """Every completion gathered so far, by index."""
        return [self.completions[key] for key in sorted(self.completions)]
