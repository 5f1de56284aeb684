"""Triton's control plane, closed: its admin key, the APIs the key guards, and the header that carries it.

Triton (2.51 included) can restrict groups of its HTTP and gRPC APIs to requests that carry a header
with a given value (``--http-restricted-api=<apis>:<header>=<value>``,
``--grpc-restricted-protocol=<apis>:<header>=<value>``). ``python -m serve`` restricts every API that
changes or inspects the server's running state: loading and unloading models with uploaded files
(``model-repository``, which also holds the repository index), shared-memory regions, log settings and
traces. Inference, health and metadata stay open (the OpenAI frontend needs only those).

The key comes from ``TRITON_ADMIN_KEY``, else the file named by ``TRITON_ADMIN_KEY_FILE``, else a
random one per start; every caller inside the launcher (drain, stub reload) sends it in the HTTP header
``triton-admin-key`` (a gRPC client sends it as ``triton-grpc-protocol-triton-admin-key``: Triton's gRPC
server prefixes the name it checks with ``triton-grpc-protocol-``). A request without it, or with another
value, gets HTTP 403 ("This API is restricted") or gRPC UNAVAILABLE ("This protocol is restricted, expecting
header 'triton-grpc-protocol-triton-admin-key'"). The model's own unload on engine death
(``serve.health``) goes through the Python backend's in-process call, not through HTTP or gRPC, and needs no
key.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ADMIN_HEADER = "triton-admin-key"
# Triton's gRPC server prefixes the header it checks: a gRPC client sends this one (metadata keys are lower case).
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
KEY_ENV, KEY_FILE_ENV = "TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY_FILE"


def admin_key(env: dict[str, str] | None = None) -> str:
    """The admin key: ``TRITON_ADMIN_KEY``, else the first line of the file ``TRITON_ADMIN_KEY_FILE`` names,
    else 32 random bytes (URL-safe base64, 43 characters) made now.

    Raises:
        ValueError: the key is empty, or holds characters a header value or Triton's flag cannot carry
            (whitespace, ``,``, ``:``, ``=``; Triton splits its flag value on the last two).
        OSError: the key file cannot be read.
    """
    env = os.environ if env is None else env
    if env.get(KEY_ENV):
        key, source = env[KEY_ENV], KEY_ENV
    elif env.get(KEY_FILE_ENV):
        path = Path(env[KEY_FILE_ENV])
        key, source = (path.read_text().splitlines() or [""])[0].strip(), f"{KEY_FILE_ENV} ({path})"
    else:
        return secrets.token_urlsafe(32)
    if not key or any(c.isspace() or c in ",:=" for c in key):
        raise ValueError(f"the Triton admin key from {source} must be non-empty, with no whitespace, ',', ':' or "
                         f"'=' (got {len(key)} characters)")
    return key


def admin_headers(key: str | None, grpc: bool = False) -> dict[str, str]:
    """The header a restricted HTTP (or, with ``grpc``, gRPC) call sends; none without a key."""
    return {GRPC_ADMIN_HEADER if grpc else ADMIN_HEADER: key} if key else {}


def restriction_args(key: str) -> list[str]:
    """tritonserver's flags that put :data:`RESTRICTED_APIS` behind ``triton-admin-key: <key>`` on HTTP and
    gRPC. The key is on tritonserver's command line (visible in ``ps`` to users of this host): Triton takes
    it no other way."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}"]
