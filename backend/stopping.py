"""When a request stops: the one stopping rule, for EOS, stop token ids, stop strings and max_tokens.

The decision is made here and nowhere else; it is applied at two points of one step, both on the thread
that steps the engine:

1. the scheduler applies it to each sampled token (``Scheduler.update_from_output``: EOS, stop token ids,
   a terminated grammar, ``max_tokens``);
2. stop strings live in text, which only the output processor has: it detokenizes the step's tokens
   (``IncrementalDetokenizer``, checking only while :func:`stop_strings_active`) and reports the requests
   whose text reached one; the engine core then applies this rule to them with ``stop_string_matched``
   (``EngineCore.finish_on_stop_strings`` -> ``Scheduler.finish_on_stop_string``), before the step's
   deltas are built. So the flow is one way per step (core -> output processor -> core), never across
   threads.

The sampler keeps EOS and stop token ids from being drawn inside ``min_tokens``
(``Sampler._apply_min_tokens``).
"""

from __future__ import annotations

from backend.request import Request, RequestStatus


def stop_strings_active(request: Request) -> bool:
    """Whether a stop string completed by the last token may end the request (not within ``min_tokens``)."""
    return request.num_output_tokens > request.params.min_tokens


def stop_status(request: Request, token_id: int, stop_string_matched: bool = False) -> RequestStatus | None:
    """Whether the token just appended ends the request, and why.

    vLLM's order: a grammar that has terminated (structured outputs), EOS (unless ``ignore_eos``) and
    ``stop_token_ids``, then a stop string completed by this
    token, then ``max_tokens``. So a last allowed token that is EOS, a stop token or the end of a stop
    string finishes with ``stop``, not ``length``. Within ``min_tokens`` only ``max_tokens`` can end it.

    Args:
        token_id: the token appended last (already in ``request.token_ids``).
        stop_string_matched: the detokenizer found a stop string ending in this token.

    Returns:
        ``FINISHED_STOPPED``, ``FINISHED_LENGTH`` or None (keep going).
    """
    params = request.params
    if request.grammar is not None and request.grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED  # structured output complete (it ends on EOS, whatever ignore_eos says)
    if stop_strings_active(request):
        if (token_id in request.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if stop_string_matched:
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
