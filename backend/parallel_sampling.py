"""Parallel sampling (``n`` > 1): one caller's request fanned out into ``n`` engine requests and fanned back in.

The engine core sees ``n`` independent requests (ids ``<id>#0`` .. ``<id>#n-1``); they share the prompt's
blocks through the prefix cache, which registers blocks as they are allocated, so the completions admitted
in the same step as the first already share its prompt blocks (only the prompt's last, partial block, or
the last full one, is computed once per completion: it holds the token whose logits each needs). With
prefix caching off they get a cache salt of their own, so they still share with each other and with
nothing else. The output processor counts the finished completions: the delta that ends the last one is
marked ``done``.
"""

from __future__ import annotations

import queue
import uuid

from backend.request import Request
from backend.sampling_params import SamplingParams


class ParentRequest:
    """The caller's view of a request: its id, its sink, and how many of its ``n`` completions are unfinished.

    Args:
        request_id: the caller's id; the completions' ids derive from it.
        params: the sampling parameters, shared by all completions (``params.n`` of them).
        sink: where the deltas of all completions go.
    """

    def __init__(self, request_id: str, params: SamplingParams, sink: queue.Queue) -> None:
        self.request_id = request_id
        self.params = params
        self.sink = sink
        self.num_unfinished = params.n

    def child_id(self, index: int) -> str:
        """The engine request id of completion ``index`` (the caller's id itself when ``n`` is 1)."""
        return self.request_id if self.params.n == 1 else f"{self.request_id}#{index}"

    @property
    def child_ids(self) -> list[str]:
        return [self.child_id(i) for i in range(self.params.n)]

    def make_requests(self, prompt_token_ids: list[int], eos_token_ids: tuple[int, ...], max_tokens: int,
                      bad_words_token_ids: list[list[int]], enable_prefix_caching: bool, priority: int = 0,
                      timeout: float | None = None, make_grammar=None, cache_salt: str | None = None,
                      fairness_key: str | None = None) -> list[Request]:
        """The ``n`` engine requests. ``cache_salt`` (vLLM's): with prefix caching on, they share cached blocks
        only with requests of the same salt. With prefix caching off and ``n`` > 1 they get a salt of their own,
        so they share with each other and nothing else; with it off and ``n`` 1 nothing is cached.
        ``priority`` and ``timeout`` (seconds) apply to each (:class:`~backend.request.Request`);
        ``make_grammar`` (no arguments) gives each completion a grammar state of its own. The completions share
        one ``fairness_key`` (the caller's id when None): together they take one turn in admission."""
        if enable_prefix_caching:
            salt = cache_salt
        else:
            salt = None if self.params.n == 1 else f"{cache_salt or ''}:{uuid.uuid4().hex}"
        return [Request(self.child_id(i), prompt_token_ids, self.params, eos_token_ids, max_tokens, i,
                        bad_words_token_ids, cache_salt=salt, priority=priority, timeout=timeout,
                        grammar=make_grammar() if make_grammar is not None else None,
                        fairness_key=self.request_id if fairness_key is None else fairness_key)
                for i in range(self.params.n)]

    def finish_child(self) -> bool:
        """Counts one finished completion; True when it was the last (the request is done)."""
        self.num_unfinished -= 1
        return self.num_unfinished == 0
