"""A model runner that computes nothing, for benchmarks of everything around the forward pass.

On a GPU the forward pass of a step at batch 256 takes tens of milliseconds or less; the scheduler, the KV
cache manager, the output processor and the serving adapter must then keep up. This runner stands in for
:class:`~backend.model_runner.ModelRunner` (``model_runner: zero_cost`` in the engine settings) so that their
cost can be measured alone: every request that reaches its last token gets the next token of a fixed cycle
at once, with no tensors, no KV cache memory and no sampler. Everything else is the real engine: the
scheduler admits, chunks and preempts under the same budgets, the KV cache manager allocates and frees the
same blocks (prefix caching included), and the output processor detokenizes and matches stop strings.

The token at position ``p`` of a sequence (``p`` = tokens before it, prompt included) is
:func:`zero_cost_token` ``(p, vocab_size)``; it is never one of the request's EOS ids, so a request runs to
``max_tokens`` (or a stop string / stop token id that the cycle happens to produce), whatever ``ignore_eos``
says. A recomputed (preempted) request therefore gets the same tokens again. Sampling parameters, logprobs
and bad words are ignored. For benchmarks only: the text it produces means nothing.
"""

from __future__ import annotations

from backend.model_runner import ModelRunnerOutput
from backend.sampler import accept_greedy
from backend.scheduler_output import SchedulerOutput

FIRST_TOKEN = 1000  # ordinary word pieces in common vocabularies (specials sit at the start or the end)
CYCLE_LENGTH = 64


def zero_cost_token(position: int, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> int:
    """The token the zero-cost runner emits at ``position`` (tokens before it in the sequence, prompt included).

    ``FIRST_TOKEN + position % CYCLE_LENGTH`` (both shrunk for a vocabulary under 2000 tokens), skipping ahead
    in the cycle past any of ``eos_token_ids``.

    Raises:
        ValueError: ``vocab_size`` below 2, or every token of the cycle is an EOS id.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    first = min(FIRST_TOKEN, vocab_size // 2)
    length = min(CYCLE_LENGTH, vocab_size - first)
    for step in range(length):
        token = first + (position + step) % length
        if token not in eos_token_ids:
            return token
    raise ValueError(f"every token of the zero-cost cycle is an EOS id: {eos_token_ids}")


class ZeroCostModelRunner:
    """Returns :func:`zero_cost_token` for every scheduled request whose chunk reaches its last token.

    Reads only the :class:`~backend.scheduler_output.SchedulerOutput`, like the real runner; holds no KV cache.
    """

    def __init__(self, vocab_size: int) -> None:
        zero_cost_token(0, vocab_size)  # raises on a vocabulary too small
        self.vocab_size = vocab_size

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """The next token of each request that samples this step; no logprobs."""
        sampled, verified = {}, {}
        for s in sched.scheduled:
            request = s.request
            if s.draft_token_ids:  # a speculative decode: the drafts that equal the cycle, then the cycle's next
                targets = [zero_cost_token(request.num_tokens + j, self.vocab_size, request.eos_token_ids)
                           for j in range(len(s.draft_token_ids) + 1)]
                verified[request.request_id] = accept_greedy(s.draft_token_ids, targets)
            elif s.num_computed_tokens + s.num_scheduled_tokens == request.num_tokens:  # ScheduledRequest.samples
                sampled[request.request_id] = zero_cost_token(request.num_tokens, self.vocab_size,
                                                              request.eos_token_ids)
        return ModelRunnerOutput(sampled, {}, verified=verified)
