"""Batched sampling: one pass over the step's logits with each request's own parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend import cpu_ops
from backend.bad_words import banned_next_tokens
from backend.request import Request
from backend.structured_output.grammar import apply_grammar_bitmask

FLOAT_MAX = torch.finfo(torch.float32).max
# The pick of a row whose request's own masks (allowed_token_ids, min_tokens, bad words, its grammar) leave no
# token: the engine core ends that request with NO_TOKEN_MESSAGE (its batch mates are untouched).
NO_TOKEN = -1


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability and the top-N alternatives (of the model's raw distribution);
    ``rank`` is the sampled token's place in that distribution (1 = the most likely), as vLLM reports it."""

    token_id: int
    logprob: float
    top: dict[int, float]
    rank: int | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Turns ``[batch, vocab]`` logits, or the model's final hidden states, into one token per request.

    Order, as in vLLM and transformers' logits processors: penalties (repetition, presence, frequency),
    the structured-output grammar's token bitmask (only rows whose request has a grammar pay for it; see
    ``backend.structured_output``), min_tokens (EOS and stop_token_ids masked), bad words (masked), then
    greedy argmax (temperature below 1e-5 included), or temperature, top-k, top-p (Holtzman et al. 2020),
    min-p and a draw. Logits stay finite
    for every finite parameter: after the penalties and after the temperature they are clamped to
    +-``FLOAT_MAX`` (a repetition penalty of 1e-45 or 3e38 would overflow them to +-inf, and inf - inf in the
    softmax is NaN); only masked tokens are -inf. Draws are inverse transform sampling
    (one uniform number per row against the row's cumulative probabilities, :func:`_draw`); a seeded request
    draws its number from its own ``torch.Generator``, so its tokens do not depend on what shares its batch.

    Greedy-only batches (every request :func:`plain_greedy`) take fast paths inside the sampler, with the same
    picks: from hidden states, the greedy head (:mod:`backend.models.greedy_head`: an fp32 head at about bf16
    cost) where it covers the rows; from logits, ``kernels/cpu``'s argmax in their dtype (no fp32 copy of bf16 ones).

    Args:
        lm_head: ``[rows, hidden_size] -> [rows, vocab]`` logits, for :meth:`from_hidden`; None when the model
            gives logits.
        greedy_head: a :class:`~backend.models.greedy_head.GreedyHead` of ``lm_head``'s weight, or None.
        native_argmax: greedy-only batches of CPU logits pick through ``cpu_ops.argmax`` (the ``cpu`` backend).
    """

    def __init__(self, lm_head=None, greedy_head=None, native_argmax: bool = False) -> None:
        self.lm_head, self.greedy_head, self.native_argmax = lm_head, greedy_head, native_argmax

    def from_hidden(self, hidden: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Samples from the model's final hidden states ``[batch, hidden_size]`` (``requests`` in order): the
        greedy head's picks when it applies, else :meth:`__call__` on ``lm_head(hidden)``.

        Raises:
            RuntimeError: the sampler was built without an ``lm_head``.
        """
        if self.lm_head is None:
            raise RuntimeError("Sampler.from_hidden needs the lm_head it was built with")
        if (self.greedy_head is not None and self.greedy_head.covers(hidden.shape[0])
                and all(plain_greedy(r) for r in requests)):
            return SamplerOutput(self.greedy_head(hidden, self.lm_head), [None] * len(requests))
        return self(self.lm_head(hidden), requests)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """
        Args:
            logits: ``[batch, vocab]`` for ``requests`` in order (any float dtype; computed in fp32).

        Returns:
            One token id per request, and logprobs for the requests that asked; ``NO_TOKEN`` (and no logprobs)
            for a request whose masks leave every token at -inf (say ``allowed_token_ids`` that are all EOS while
            ``min_tokens`` holds EOS off).
        """
        if self.native_argmax and logits.device.type == "cpu" and all(plain_greedy(r) for r in requests):
            # the argmax of the logits (fp32, or the model's dtype) equals that of their fp32 copy
            return SamplerOutput(cpu_ops.argmax(logits).tolist(), [None] * len(requests))
        logits = logits.float()
        want_logprobs = [r.params.logprobs is not None for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        logits = self._apply_bias_and_allowed(logits, requests)
        logits = self._apply_penalties(logits, requests)
        grammar_rows = apply_grammar_bitmask(logits, [r.grammar for r in requests])
        # Where min_tokens or bad words would leave a grammar nothing to pick, the grammar wins.
        kept = {i: logits[i].clone() for i in grammar_rows
                if requests[i].num_output_tokens < requests[i].params.min_tokens or requests[i].bad_words_token_ids}
        logits = self._apply_min_tokens(logits, requests)
        logits = self._apply_bad_words(logits, requests)
        for i, row in kept.items():
            if bool(torch.isneginf(logits[i]).all()):
                logits[i] = row
        dead = {i for i, r in enumerate(requests) if _masks(r) and bool(torch.isneginf(logits[i]).all())}
        # max(dim).indices is argmax (the first maximal index); on CPU torch's argmax takes a slower path
        token_ids = logits.max(dim=-1).indices
        sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy and i not in dead]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            token_ids[rows] = self._sample(logits[rows], [requests[i] for i in sampled_rows])

        ids = token_ids.tolist()
        for i in dead:
            ids[i] = NO_TOKEN
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, request in enumerate(requests):
                if want_logprobs[i] and i not in dead:
                    logprobs[i] = _logprobs(raw_logprobs[i], ids[i], request.params.logprobs)
        return SamplerOutput(ids, logprobs)

    @staticmethod
    def _apply_bias_and_allowed(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """``logit_bias`` added, and everything outside ``allowed_token_ids`` masked (-inf)."""
        for i, request in enumerate(requests):
            params = request.params
            if params.allowed_token_ids is not None:
                allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long)
                kept = logits[i, allowed]
                logits[i] = float("-inf")
                logits[i, allowed] = kept
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
                logits[i, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests)
                if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty]
        for i in rows:  # only requests that asked for penalties pay for them
            params = requests[i].params
            row = logits[i]
            masked = torch.isneginf(row) if params.allowed_token_ids is not None else None
            output = torch.tensor(requests[i].output_token_ids, dtype=torch.long)
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(requests[i].token_ids, dtype=torch.long).unique()
                values = row[seen]
                row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
            if output.numel() and (params.presence_penalty or params.frequency_penalty):
                counts = torch.bincount(output, minlength=row.shape[0]).to(row.dtype)
                row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
            row.clamp_(-FLOAT_MAX, FLOAT_MAX)
            if masked is not None:  # the clamp made them finite: tokens outside allowed_token_ids stay masked
                row.masked_fill_(masked, float("-inf"))
        return logits

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        for i, request in enumerate(requests):
            params = request.params
            if request.num_output_tokens < params.min_tokens:
                banned = [*params.stop_token_ids, *request.eos_token_ids]
                if banned:
                    logits[i, banned] = float("-inf")
        return logits

    @staticmethod
    def _apply_bad_words(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        for i, request in enumerate(requests):
            if request.bad_words_token_ids:
                banned = banned_next_tokens(request.token_ids, request.bad_words_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """``logits`` ``[rows, vocab]`` of non-greedy requests -> ``[rows]`` token ids."""
        temperatures = [r.params.temperature for r in requests]
        if any(t != 1.0 for t in temperatures):
            temperature = torch.tensor(temperatures, dtype=logits.dtype)
            logits = (logits / temperature[:, None]).clamp_(min=-FLOAT_MAX, max=FLOAT_MAX).masked_fill_(
                logits == float("-inf"), float("-inf"))  # finite, except what was masked before
        top_k = [r.params.top_k for r in requests]
        top_p = [r.params.top_p for r in requests]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([r.params.min_p for r in requests], dtype=probs.dtype)
        if bool((min_p > 0).any()):
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return _draw(probs, requests)


def _draw(probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """One token per row of ``probs`` ``[rows, vocab]`` (non-negative, each row's sum positive, not necessarily 1),
    drawn with probability proportional to its entry: inverse transform sampling, one uniform number per row
    (from the request's own generator when it has a seed) against the row's cumulative sum in float64, so a
    token of probability 0 is never drawn and rounding moves no token's share by more than about 1e-16.

    One uniform number per row instead of one per vocabulary entry (the exponential race of vLLM's sampler,
    ``argmax(probs / Exp(1))``): on a CPU, torch draws random numbers one at a time, and the race's 49,152
    exponentials per row cost as much as the forward pass of a small model's step. Returns ``[rows]`` int64
    token ids.
    """
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    total = cdf[:, -1:]
    uniform = torch.rand(len(requests), 1, dtype=torch.float64)
    for i, request in enumerate(requests):
        if request.generator is not None:
            uniform[i] = torch.rand(1, dtype=torch.float64, generator=request.generator)
    # u in [0, total): the first entry of the cumulative sum above u is a token of positive probability.
    u = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks to -inf what top-k and top-p drop, with one descending sort for the whole batch."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k])
    positions = torch.arange(vocab)[None, :]
    drop = positions >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below top_p, and the most likely token whatever top_p is (one
    # under fp32's smallest, 1e-300, is 0 here: it would drop every token). Only in rows that ask: fp32's running
    # sum reaches 1.0 before the vocabulary's tail, so top_p 1 would drop thousands of tail tokens, and a row's
    # draw would depend on whether a batch mate asked for top-k or top-p.
    mass_before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, dtype=probs.dtype)[:, None]
    drop |= (mass_before >= p) & (p < 1.0)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(row: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    top = {}
    if top_n:
        values, indices = row.topk(top_n)
        top = dict(zip(indices.tolist(), values.tolist()))
    logprob = row[token_id]
    return TokenLogprobs(token_id, logprob.item(), top, int((row > logprob).sum()) + 1)


def accept_greedy(draft_token_ids, target_token_ids: list[int]) -> list[int]:
    """Verifies a speculative decode's drafts under greedy decoding (Leviathan et al., ICML 2023, "Fast Inference
    from Transformers via Speculative Decoding", sec. 2.3, with temperature 0: a draft is accepted exactly when
    it is the target's argmax).

    Args:
        draft_token_ids: the k drafts.
        target_token_ids: ``[k + 1]``, the argmax after the request's last token and after each draft.

    Returns:
        The accepted drafts (the longest prefix equal to the targets before them) and then the target after the
        last accepted one (the bonus token when all are accepted): 1 to k + 1 tokens, exactly what k + 1 plain
        greedy steps would give up to the first mismatch.
    """
    accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        accepted += 1
    return list(target_token_ids[:accepted + 1])


def _masks(request: Request) -> bool:
    """Whether the sampler masks any token of ``request`` to -inf (so that it could mask them all)."""
    params = request.params
    return (params.allowed_token_ids is not None or request.grammar is not None or bool(request.bad_words_token_ids)
            or request.num_output_tokens < params.min_tokens)


def plain_greedy(request: Request) -> bool:
    """Greedy with nothing that changes the logits first and no logprobs wanted."""
    params = request.params
    return (params.greedy and params.logprobs is None and params.repetition_penalty == 1.0
            and not params.presence_penalty and not params.frequency_penalty
            and request.num_output_tokens >= params.min_tokens and not request.bad_words_token_ids
            and request.grammar is None and not params.logit_bias and params.allowed_token_ids is None)
