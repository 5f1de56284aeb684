"""Aborting a streaming request by a key its client chose, on the same gRPC stream, instead of cancelling it.

A client that gives a generation request the parameter ``abort_key`` (a random string of 16 to 256 characters,
known only to it) can end that request early by sending, on the same stream, a request with the parameter
``abort`` set to the key and no prompt. The model aborts the request in the engine: it ends with finish_reason
``abort`` and its FINAL response, and its KV blocks are freed. The abort request itself gets an empty FINAL
(sent to the client only where it asked for empty final responses) and never an error for a key it does not know:
the request may have finished already. The client then half-closes the stream and Triton ends it normally.

Why not Triton's own cancellation (``is_cancelled``, which the model also honours): tritonserver 2.51's gRPC
frontend can lose track of a stream cancelled around the moment its request completes, and the leaked stream
state keeps the model loaded, so an unload, and with it a SIGTERM, waits until Triton's exit timeout and the
server exits 1 (seen with clients that leave a few milliseconds around the end of short answers). The OpenAI
frontend ends requests whose HTTP client left this way.
"""

from __future__ import annotations

ABORT_KEY = "abort_key"  # parameter of a generation request: the key that aborts it
ABORT = "abort"  # parameter of an abort request: the key of the request to abort
MIN_KEY_CHARS, MAX_KEY_CHARS = 16, 256


def abort_key(parameters: dict, name: str = ABORT_KEY) -> str | None:
    """The key in a request's ``parameters`` under ``name`` (None when absent).

    Raises:
        ValueError: not a string of ``MIN_KEY_CHARS`` to ``MAX_KEY_CHARS`` characters.
    """
    key = parameters.get(name)
    if key is None:
        return None
    if not isinstance(key, str) or not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
        raise ValueError(f"{name} must be a string of {MIN_KEY_CHARS} to {MAX_KEY_CHARS} characters")
    return key
