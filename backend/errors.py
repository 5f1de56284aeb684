"""Why the engine refuses a request that is itself valid: it is full, or it is broken.

Callers map both to "try again elsewhere or later" (Triton's UNAVAILABLE, HTTP 503), unlike the
``ValueError`` of a bad request (INVALID_ARG, HTTP 400).
"""

from __future__ import annotations


class EngineUnavailableError(RuntimeError):
    """The engine cannot take this request now; a valid request, refused before anything was queued."""


class EngineOverloadedError(EngineUnavailableError):
    """The waiting queue is at its bound (``max_num_waiting_requests`` / ``max_num_waiting_tokens``)."""


class EngineDeadError(EngineUnavailableError):
    """The engine loop has stopped, or its steps keep failing; it serves nothing until restarted."""
