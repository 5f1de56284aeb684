"""One completion's grammar state, and the batched token bitmask the sampler applies."""

from __future__ import annotations

import torch


class Grammar:
    """Follows one completion's output tokens through a compiled grammar (an xgrammar ``GrammarMatcher``).

    Each completion of an ``n`` > 1 request has its own. The state survives preemption (recompute keeps the
    tokens, and the matcher has seen exactly the output tokens) and prefix caching (which concerns the
    prompt's KV, not the output). The grammar terminates after it accepts one of ``stop_token_ids`` in a
    state where the grammar is complete; then the request finishes with ``stop``.

    Args:
        compiled: from :meth:`~backend.structured_output.GrammarCompiler.compile`.
        stop_token_ids: the tokens that may end the output once the grammar is complete (the model's EOS).
    """

    def __init__(self, compiled, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)

    def accept(self, token_id: int) -> bool:
        """Advances past ``token_id``; False (state unchanged) when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (``[batch, ceil(vocab / 32)]`` int32, bit set =
        allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammar_bitmask(logits: torch.Tensor, grammars: list[Grammar | None]) -> list[int]:
    """Masks to -inf, in place, each row's tokens its grammar does not allow; rows without a grammar (None),
    or whose grammar has terminated, are untouched and cost nothing.

    Args:
        logits: ``[batch, vocab]`` fp32, one row per entry of ``grammars``.

    Returns:
        The rows that were masked.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.is_terminated()]
    if not rows:
        return rows
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
    return rows
