"""A request body whose JSON holds a lone UTF-16 surrogate is answered 400.

JSON may spell a character outside the Basic Multilingual Plane as an escaped surrogate pair
(``"\\ud83d\\ude00"``); Python's parser also accepts half a pair (``"\\ud83d"``) and yields a string that is not
Unicode text: it cannot be encoded as UTF-8, so it could reach neither the tokenizer nor Triton. Such a body is
refused here, before any route sees it, with OpenAI's error body, instead of failing somewhere inside
(a 500). Bodies are scanned for a surrogate escape with one regular-expression pass over the bytes; only a body
that has one is parsed here, off the event loop, to tell a pair from a lone half.
"""

from __future__ import annotations

import asyncio
import json
import re

from openai_frontend.auth import send_error
from openai_frontend.errors import OpenAIError
from openai_frontend.limits import replaying

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def has_lone_surrogate(body: bytes) -> bool:
    """Whether the JSON document ``body`` has a string (or key) holding an unpaired surrogate.

    A body that is not JSON is not judged here (False): the route's own parser answers it."""
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        return False
    return False


class LoneSurrogateMiddleware:
    """Pure ASGI middleware: a POST body is read in full (the routes parse it whole anyway), checked with
    :func:`has_lone_surrogate` where it holds a surrogate escape, then handed on from memory."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was complete
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if SURROGATE_ESCAPE.search(body) and await asyncio.to_thread(has_lone_surrogate, body):
            return await send_error(send, OpenAIError(
                400, "the request holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                     "a Unicode character", "invalid_value"))
        await self.app(scope, replaying(body, receive), send)
