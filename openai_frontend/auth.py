"""The frontend's API key: ``Authorization: Bearer <key>`` on every route but ``/health`` and ``/metrics``.

The key is optional (``--api-key`` / ``LLM_API_KEY``, or a file: ``--api-key-file`` / ``LLM_API_KEY_FILE``);
without one every route is open, as before. With one, a request without the header, or with another key,
gets 401 and OpenAI's error body (``code`` ``invalid_api_key``, as api.openai.com answers), before its
body is read. ``/docs``, ``/redoc`` and ``/openapi.json`` need the key too; ``/health`` (the
orchestrator's probe) and ``/metrics`` (Prometheus) stay open, as in vLLM, whose ``--api-key`` guards
only ``/v1``. The comparison is constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path

from openai_frontend.errors import OpenAIError

OPEN_PATHS = frozenset({"/health", "/metrics"})
# vLLM's render endpoints: token ids only, nothing generated. ``--open-render`` leaves them open for a caller that
# cannot send a key (the Inference Extension's endpoint picker tokenizes through them; its token producer has no
# setting for one).
RENDER_PATHS = frozenset({"/v1/completions/render", "/v1/chat/completions/render"})
KEY_ENV, KEY_FILE_ENV = "LLM_API_KEY", "LLM_API_KEY_FILE"


def load_api_key(key: str | None = None, key_file: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None) -> str | None:
    """The API key: ``key``, else the first line of ``key_file``, else ``LLM_API_KEY``, else the first line
    of the file ``LLM_API_KEY_FILE`` names; None when none is set (no key: every route open).

    Raises:
        ValueError: both a key and a key file given at the same level (flags, or environment), or the key
            is empty (an empty ``LLM_API_KEY`` counts as unset) or holds whitespace.
        OSError: the key file cannot be read.
    """
    env = os.environ if env is None else env
    if key == "":  # given, but empty (an unset variable expanded into the flag): not a request for no key
        raise ValueError("--api-key is empty: give a key, or leave the flag out to serve without one")
    for value, path, source in ((key, key_file, "--api-key and --api-key-file"),
                                (env.get(KEY_ENV), env.get(KEY_FILE_ENV), f"{KEY_ENV} and {KEY_FILE_ENV}")):
        if value and path:
            raise ValueError(f"{source} are both set; give one")
        if path:
            lines = Path(path).read_text().splitlines()
            value = lines[0].strip() if lines else ""
            if not value:
                raise ValueError(f"the API key file {path} is empty")
        if value is not None and value != "":
            if any(c.isspace() for c in value):
                raise ValueError("the API key must not hold whitespace")
            return value
    return None


class APIKeyMiddleware:
    """Pure ASGI middleware: answers 401 unless the request carries ``Authorization: Bearer <key>``.

    Args:
        key: the expected key (compared as UTF-8 bytes in constant time).
    """

    def __init__(self, app, key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.expected = key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        sent = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = sent.strip().partition(b" ")
        # The scheme's name is case-insensitive (RFC 9110, sec. 11.1); the key is compared exactly.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided." if sent else
                   "You didn't provide an API key. You need to provide your API key in an Authorization header "
                   "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        await send_error(send, OpenAIError(401, message, "invalid_api_key"),
                         extra_headers=[(b"www-authenticate", b"Bearer")])


async def send_error(send, error: OpenAIError, extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    """Sends ``error`` as a complete JSON response (OpenAI's body) through ASGI ``send``."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *extra_headers]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def protect(app, key: str | None, open_render: bool = False) -> None:
    """Puts ``app`` behind :class:`APIKeyMiddleware` when ``key`` is set (the outermost middleware when
    called last); ``open_render``: :data:`RENDER_PATHS` need no key either."""
    if key:
        app.add_middleware(APIKeyMiddleware, key=key, open_paths=OPEN_PATHS | (RENDER_PATHS if open_render else set()))
