"""Draft tokens for speculative decoding by n-gram prompt lookup: no draft model, only the request's own tokens.

Prompt lookup decoding (Saxena, 2023; vLLM's ``speculative_config={"method": "ngram", ...}``): when the last
n tokens of a request (prompt + output so far) occurred earlier in it, the tokens that followed that earlier
occurrence are a good guess of what comes next. Outputs that copy from their context (code edits, summaries,
extraction) repeat long runs of it, so the guess is often right. The target model then scores the guesses in one
forward pass and keeps the longest prefix it agrees with (verification as in Leviathan et al., ICML 2023, "Fast
Inference from Transformers via Speculative Decoding"; ``backend.sampler.accept_greedy``).

Matching: for n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the most recent earlier occurrence of the
last n tokens; the first n that occurs wins (the longest match), and up to ``k`` tokens that follow it are the
drafts. The search runs over the token ids packed as 32-bit integers with ``bytes.rfind`` (C speed: about 15 us
for 2,000 tokens without a match, measured on one core), keeping only 4-byte-aligned hits.

Which requests may speculate is :func:`can_speculate`'s decision (greedy and nothing that makes a token depend on
more than the logits of its position).
"""

from __future__ import annotations

from array import array

from backend.request import Request

_ITEM = 4  # bytes per token id in the packed search buffer (array typecode "I")


class NgramProposer:
    """Proposes draft tokens for a request from an earlier occurrence of its last n tokens.

    Args:
        num_speculative_tokens: the most drafts per step (k), >= 1.
        prompt_lookup_min / prompt_lookup_max: the shortest and longest suffix (tokens) matched, 1 <= min <= max.

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min} and "
                             f"{prompt_lookup_max}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Draft tokens to follow ``token_ids``.

        Args:
            token_ids: the request's tokens so far (prompt + output).
            max_drafts: a tighter cap than ``k`` (token budget, ``max_tokens``); None: ``k``.

        Returns:
            Up to ``min(k, max_drafts)`` token ids, empty when no suffix of ``prompt_lookup_min`` or more tokens
            occurred earlier.
        """
        limit = self.k if max_drafts is None else min(self.k, max_drafts)
        num_tokens = len(token_ids)
        if limit <= 0 or num_tokens <= self.min_n:
            return []
        packed = array("I", token_ids).tobytes()
        # An earlier occurrence ends before the last token, so at least one token follows it.
        haystack_end = (num_tokens - 1) * _ITEM
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            needle = packed[-n * _ITEM:]
            end = haystack_end
            while True:
                at = packed.rfind(needle, 0, end)
                if at < 0:
                    break
                if at % _ITEM == 0:
                    start = at // _ITEM + n
                    return token_ids[start:start + limit]
                end = at + len(needle) - 1  # a misaligned hit: look again to its left
        return []


def can_speculate(request: Request) -> bool:
    """Whether ``request`` may decode with drafts: its tokens are then exactly what it would get without them.

    Greedy (temperature below 1e-5) only: sampled requests decode one token a step. Also excluded, because the
    sampler's result at a position would depend on more than that position's logits, or because the
    request wants per-token data the verification step does not produce: logprobs, repetition / presence /
    frequency penalties, ``logit_bias``, ``allowed_token_ids``, bad words, structured outputs (a grammar), and
    ``min_tokens`` not reached yet. Prompt logprobs, stop strings, stop token ids, ``n`` > 1 and ``max_tokens`` are
    fine (accepted tokens go through the stopping rule one by one).
    """
    params = request.params
    return (params.greedy and params.logprobs is None and params.repetition_penalty == 1.0
            and not params.presence_penalty and not params.frequency_penalty and not params.logit_bias
            and params.allowed_token_ids is None and not request.bad_words_token_ids and request.grammar is None
            and request.num_output_tokens >= params.min_tokens)
