"""OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``) and the status of Triton's errors.

Triton's gRPC stream carries an error's message but not its code, so the status is read from the message, by
how it begins (a bad request's message may quote anything its client sent, so nothing is searched for inside
it): Triton's unknown model is 503 (the frontend found the model ready just before: it was unloaded since, by a
drain or a fault, and a retry elsewhere or later may succeed), the engine's refusals of a valid request
(``backend.errors.UNAVAILABLE_MESSAGE_STARTS``: full, draining, dead) 503, the model's ``internal error: ...``
500, and anything else the model rejected (its validation of the request) 400, its ``param`` the sampling field
the message begins with (after an ``invalid``: a constraint that does not compile).
"""

from __future__ import annotations

import dataclasses
import re

from backend.errors import UNAVAILABLE_MESSAGE_STARTS
from backend.sampling_params import SamplingParams

TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "internal_server_error",
         503: "service_unavailable"}
_NOT_READY = re.compile(r"Request for unknown model\b")  # Triton's own words; matched at the start
_UNAVAILABLE = re.compile("|".join(re.escape(start) for start in UNAVAILABLE_MESSAGE_STARTS))
_LEADING_NAME = re.compile(r"(?:invalid )?([a-z_]+)\b")  # "max_tokens must be", "invalid structured_outputs.json:"
_SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams)) | {"cache_salt", "priority"}


class OpenAIError(Exception):
    """An error to answer with ``status`` and OpenAI's body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def internal_error() -> OpenAIError:
    """The answer to an exception that no check expected (a bug): a 500 in OpenAI's shape whose message tells
    nothing of the code; the traceback goes to the server's log."""
    return OpenAIError(500, "internal error: the server failed on this request (the details are in its log)",
                       "internal_error")


def error_from_triton(message: str) -> OpenAIError:
    """The OpenAIError for an error message that Triton or the model sent on the stream."""
    if _NOT_READY.match(message):
        return OpenAIError(503, message, "model_not_ready", "model")
    if _UNAVAILABLE.match(message):
        return OpenAIError(503, message, "service_unavailable")
    if message.startswith(("internal error", "generation failed")):
        return OpenAIError(500, message, "internal_error")
    leading = _LEADING_NAME.match(message)  # the engine's checks begin with the field's name: "max_tokens must be"
    return OpenAIError(400, message, "invalid_request",
                       leading.group(1) if leading and leading.group(1) in _SAMPLING_FIELDS else None)
