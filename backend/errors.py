"""Why the engine refuses a request that is itself valid: it is full, or it is broken.

Callers map both to "try again elsewhere or later" (Triton's UNAVAILABLE, HTTP 503), unlike the
``ValueError`` of a bad request (INVALID_ARG, HTTP 400).
"""

from __future__ import annotations

# How every EngineUnavailableError's message begins. A caller that sees only the text (the OpenAI frontend reads
# Triton's gRPC stream, which carries an error's message but not its code) matches these at the start and nothing
# else: a bad request's message may quote anything its client sent (a schema's property names, stop strings).
# tests/test_errors.py checks every place that raises one.
UNAVAILABLE_MESSAGE_STARTS = ("server is full:", "server is shutting down", "the engine is shutting down",
                              "engine is dead", "the grammar compile")

# The error of a request that its own settings ended mid-generation (finish_reason "error"): a fault its client can
# fix, answered like a refused request (INVALID_ARG, HTTP 400), not as an internal error. Matched at the start.
NO_TOKEN_MESSAGE = ("no token can be sampled: this request's allowed_token_ids, min_tokens (which holds EOS and "
                    "stop_token_ids off), bad_words and structured output together mask every token")
REQUEST_ERROR_STARTS = ("no token can be sampled",)


class EngineUnavailableError(RuntimeError):
    """The engine cannot take this request now; a valid request, refused before anything was queued."""


class EngineOverloadedError(EngineUnavailableError):
    """The waiting queue is at its bound (``max_num_waiting_requests`` / ``max_num_waiting_tokens``)."""


class EngineDeadError(EngineUnavailableError):
    """The engine loop has stopped, or its steps keep failing; it serves nothing until restarted."""
