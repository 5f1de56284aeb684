"""Bounds on what one request may cost the frontend and the engine, checked before the work starts.

* The request body: at most ``max_request_body_bytes`` (default 8 MiB). A ``Content-Length`` over it is
  answered 413 before a byte of the body is read; a chunked body is counted as it arrives and answered
  413 once it passes the bound, so no body over it is ever held in memory or parsed
  (:class:`BodyLimitMiddleware`, pure ASGI; the idea is nginx's ``client_max_body_size``).
* The completions one request asks for: its prompts times ``n`` at most ``max_prompts_per_request``
  (default 256), answered 400, so that one request cannot fill the engine's waiting queue (1,024
  completions by default) on its own (:func:`check_completion_count`).
* The render endpoints' tokenizing: off the event loop, each prompt first held to the size bound that
  generation uses (``backend.prompt_limits``: the longest prompt, in UTF-8 bytes, that could still fit
  ``max_model_len``), so that a long prompt neither stalls other requests nor costs more than generation
  would accept (:func:`render_token_ids`), the ids computed with the GIL released
  (``backend.prompt_limits.encode_prompt``), and the answer written as JSON on a worker thread a slice of
  the ids at a time (:func:`json_response`), so that neither the event loop nor the GIL is held for long.

Errors are in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from fastapi.responses import Response

from backend.prompt_limits import check_prompt_bytes, encode_prompt, max_token_bytes
from openai_frontend.auth import send_error
from openai_frontend.errors import OpenAIError
from openai_frontend.models import tokenizer_for

log = logging.getLogger("openai_frontend")
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256


@dataclass
class Limits:
    """Args: max_request_body_bytes: largest request body, bytes. max_prompts_per_request: most
    completions (prompts times ``n``) one request may ask for."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1 or self.max_prompts_per_request < 1:
            raise ValueError(f"limits must be >= 1, got {self}")


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Pure ASGI middleware: 413 for a request body over ``limit`` bytes; 415 for a body sent with a
    ``Content-Encoding`` (gzip, deflate, ...) other than ``identity``, which nothing here decodes (read as JSON, it
    would fail as text that is not UTF-8, or be taken as it is).

    A body with ``Content-Length`` is checked from the header and then passed on as it streams (the server
    enforces the declared length). A body without one (chunked) is read here up to the limit, then
    handed to the app from memory; the app reads the whole body anyway to parse it.
    """

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        encoding = next((value for name, value in scope["headers"] if name == b"content-encoding"), b"identity")
        if encoding.strip().lower() != b"identity":
            return await send_error(send, OpenAIError(
                415, f"Content-Encoding {encoding.decode('latin-1')[:40]!r} is not supported: send the body "
                     "uncompressed", "unsupported_media_type"))
        length = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if length is not None:
            if not length.isdigit():
                return await send_error(send, OpenAIError(400, "Content-Length is not a number", "invalid_request"))
            if int(length) > self.limit:
                return await self._refuse(send, int(length))
            return await self.app(scope, receive, send)
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body was complete
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(send, size, at_least=True)
            if not message.get("more_body", False):
                break
        await self.app(scope, replaying(b"".join(chunks), receive), send)

    async def _refuse(self, send, size: int, at_least: bool = False) -> None:
        await send_error(send, OpenAIError(
            413, f"request body is {'over ' if at_least else ''}{size} bytes; at most {self.limit} are accepted "
                 f"(--max-request-body-bytes)", "request_too_large"))


def replaying(body: bytes, receive):
    """An ASGI ``receive`` for a body read already: ``body`` as one message, then the server's own messages
    (``http.disconnect``) from ``receive``."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def install_limits(app, limits: Limits) -> None:
    """Puts ``app`` behind :class:`BodyLimitMiddleware` and keeps ``limits`` in ``app.state.limits``."""
    app.state.limits = limits
    app.add_middleware(BodyLimitMiddleware, limit=limits.max_request_body_bytes)


def check_completion_count(num_prompts: int, n: int | None, limits: Limits) -> None:
    """Raises:
        OpenAIError: 400, ``num_prompts * n`` over ``limits.max_prompts_per_request``."""
    count = num_prompts * (n or 1)
    if count > limits.max_prompts_per_request:
        raise OpenAIError(400, f"the request asks for {count} completions ({num_prompts} prompt(s) times n="
                               f"{n or 1}); at most {limits.max_prompts_per_request} per request "
                               f"(--max-prompts-per-request)", "invalid_value", "prompt")


async def render_token_ids(tokenizer, prompts: list[str | list[int]], max_model_len: int,
                           add_special_tokens: bool = True, param: str = "prompt") -> list[list[int]]:
    """The token ids of each prompt (token-id prompts as they are), computed on a worker thread; each text
    prompt is first held to the bytes that could fit ``max_model_len`` tokens (``backend.prompt_limits``), as
    the engine does before tokenizing.

    Raises:
        OpenAIError: 400 naming ``param`` (the request's field the prompt came from), a prompt over that bound.
    """
    def encode() -> list[list[int]]:
        check = prompt_bytes_check(tokenizer, max_model_len, param)
        for prompt in prompts:
            if isinstance(prompt, str):
                check(prompt)
        return [encode_prompt(tokenizer, prompt, add_special_tokens) if isinstance(prompt, str) else prompt
                for prompt in prompts]

    return await asyncio.to_thread(encode)


def prompt_bytes_check(tokenizer, max_model_len: int, param: str = "prompt") -> Callable[[str], None]:
    """A check of a text prompt, before tokenizing it, against the bytes that could fit ``max_model_len`` tokens
    (``backend.prompt_limits``): it raises OpenAIError 400 naming ``param`` for a longer one."""
    limit = (max_model_len - 1) * _max_token_bytes(tokenizer)

    def check(text: str) -> None:
        try:
            check_prompt_bytes(text, limit, max_model_len)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "invalid_value", param) from None
    return check


JSON_SLICE = 8192  # list items written by one json.dumps call (about 1 ms for ints): the GIL is held that long


async def json_response(payload) -> Response:
    """A 200 JSON answer of ``payload`` (dicts with string keys, lists, scalars), written on a worker thread, each
    long list a :data:`JSON_SLICE` of items at a time. FastAPI's own answer runs ``jsonable_encoder`` over every
    item on the event loop (0.24 s for 330,000 token ids), and one ``json.dumps`` of it all holds the GIL
    throughout (27 ms); here the loop is free and the GIL is let go between slices. The text is what Starlette's
    ``JSONResponse`` writes (compact separators, UTF-8, no NaN)."""
    text = await asyncio.to_thread(_dumps, payload)
    return Response(text.encode("utf-8"), media_type="application/json")


def _dumps(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{_dumps(str(k))}:{_dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)) and len(value) > JSON_SLICE:
        return "[" + ",".join(_dumps(list(value[i:i + JSON_SLICE]))[1:-1]
                              for i in range(0, len(value), JSON_SLICE)) + "]"
    if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
        return "[" + ",".join(_dumps(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def warm_tokenizers(repository: Path, tokenizer: str | None) -> int:
    """Loads now every tokenizer the repository's model versions use (``openai_frontend.models``), with its
    longest token's size (:func:`render_token_ids`'s bound); returns how many were loaded.

    A first load is seconds of Python work (Hugging Face's loader, then a pass over the vocabulary). On a worker
    thread while requests are served, it would still take the GIL from the event loop for that long, in
    5 ms turns, and delay every other request; the frontend does it before it starts serving instead. A
    version whose tokenizer cannot be loaded is skipped (its requests get the error then).
    """
    loaded = 0
    models = [p for p in repository.iterdir() if p.is_dir()] if repository.is_dir() else []
    for model in models:
        for version in [""] + [p.name for p in model.iterdir() if p.name.isdigit()]:
            try:
                _max_token_bytes(tokenizer_for(repository, tokenizer, model.name, version))
                loaded += 1
            except Exception as exc:  # noqa: BLE001 - reported when a request needs it
                log.warning("tokenizer of %s version %r not loaded ahead: %s", model.name, version or "newest", exc)
    return loaded


@lru_cache(maxsize=8)
def _max_token_bytes(tokenizer) -> int:
    return max_token_bytes(tokenizer)
