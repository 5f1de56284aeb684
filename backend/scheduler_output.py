"""What one step computes: the scheduler's answer, and everything the model runner needs from it.

The data path is one way: ``Scheduler.schedule()`` builds a :class:`SchedulerOutput`, the model runner
reads only it (never the scheduler's queues or the KV cache manager's tables), and
``Scheduler.update_from_output()`` applies the runner's result. Like nano-vllm, each scheduled request
carries its whole block table every step (vLLM's ``NewRequestData`` sends it once and
``CachedRequestData`` only the new block ids, for a runner that keeps per-request state; ours keeps none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.request import Request


def is_decode(request: Request, num_scheduled_tokens: int) -> bool:
    """A decode: one token of a request that has generated (its last token; or, recomputed after a preemption,
    a one-token chunk of its sequence). A prompt's chunk of one token (its last token where the step's budget
    split it off, or a one-token prompt) is prefill: its attention runs in the prefill kernel, as when the same
    position comes in a longer chunk, so a request's numbers do not depend on how its prompt was chunked beside
    other requests (the decode kernel rounds differently, about 1e-6). Read before the step's forward pass
    (the sampled token changes the answer)."""
    return num_scheduled_tokens == 1 and request.num_output_tokens > 0


@dataclass
class ScheduledRequest:
    """One request's share of the step.

    Attributes:
        request: its tokens, sampling parameters and generator (the runner and sampler read them only).
        num_computed_tokens: tokens whose K/V are already cached; this step's chunk starts here.
        num_scheduled_tokens: tokens computed this step (1 for a decode; 1 + the drafts for a speculative one).
        block_ids: the request's block table after this step's allocation, in token order; covers
            ``num_computed_tokens + num_scheduled_tokens`` tokens.
        draft_token_ids: a speculative decode's draft tokens (:mod:`backend.ngram_proposer`), computed after the
            request's last token; empty otherwise. They are not the request's tokens until verified.
    """

    request: Request
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list[int]
    draft_token_ids: list[int] | tuple[()] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def seq_len(self) -> int:
        """Context length after this step, in tokens (cached prefix + this chunk)."""
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens computed this step (a speculative decode's drafts last)."""
        if self.draft_token_ids:
            return self.request.token_ids[self.num_computed_tokens:] + list(self.draft_token_ids)
        return self.request.token_ids[self.num_computed_tokens:self.seq_len]

    @property
    def is_decode(self) -> bool:
        return not self.draft_token_ids and is_decode(self.request, self.num_scheduled_tokens)

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token: its logits give the next token (with drafts: the
        logits of the last token and of every draft verify them)."""
        return self.seq_len - len(self.draft_token_ids) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What to compute this step: decodes (:func:`is_decode`) first, then prefill chunks and speculative decodes,
    so the model runner can batch the decodes. ``num_draft_tokens``: drafts over all requests (0 without
    speculation); ``num_decodes``: how many requests at the front decode."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_decodes: int = 0  # the decodes at the front, counted when scheduled (is_decode reads request state)

    @property
    def requests(self) -> list[Request]:
        return [s.request for s in self.scheduled]

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return [s.num_scheduled_tokens for s in self.scheduled]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def num_prefills(self) -> int:
        return len(self.scheduled) - self.num_decodes - sum(1 for s in self.scheduled if s.draft_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
