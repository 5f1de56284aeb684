"""Which models Triton serves under which OpenAI ids, and what the frontend reads of each from the model repository
(its tokenizer, ``max_model_len`` and vocabulary size), as the engine reads its model."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from functools import lru_cache
from pathlib import Path

from openai_frontend.errors import OpenAIError
from openai_frontend.triton_stream import TritonLLM

log = logging.getLogger("openai_frontend")


async def model_ids(triton: TritonLLM) -> list[str]:
    """``name`` (the version Triton picks by its version policy) and ``name/version`` for each READY one."""
    ids: list[str] = []
    for name, version in sorted(await triton.models()):
        if name not in ids:
            ids.append(name)
        if version:
            ids.append(f"{name}/{version}")
    return ids


async def resolve(triton: TritonLLM, model_id: str) -> tuple[str, str]:
    """``name`` or ``name/version`` -> (name, version).

    Raises:
        OpenAIError: 503 for a model this frontend serves with no version ready (loading, restarting after a
            fault, or unloaded by a drain: a client or gateway retries elsewhere or later); 404 for a name it
            does not serve, or a version that is not ready while another is.
    """
    ids = await model_ids(triton)
    if model_id not in ids:
        name = model_id.partition("/")[0]
        if name in triton.offered() and name not in ids:
            raise OpenAIError(503, f"The model `{name}` is not ready (loading, restarting or draining); retry shortly.",
                              "model_not_ready", "model")
        raise OpenAIError(404, f"The model `{model_id}` does not exist.", "model_not_found", "model")
    name, _, version = model_id.partition("/")
    return name, version


class ModelFiles:
    """What the routes read of a model version's files, off the event loop: the first read of a tokenizer or a
    model config takes seconds of file and Python work (cached after), and settings are read from
    config.pbtxt and engine.json on every call, so that a version loaded anew is read as its engine reads it.

    Args:
        repository: the Triton model repository; tokenizer: one tokenizer for every model (None: each model's own).
    """

    def __init__(self, repository: Path, tokenizer: str | None) -> None:
        self.repository = repository
        self.tokenizer_source = tokenizer

    async def tokenizer(self, name: str, version: str):
        """:func:`tokenizer_for` the version."""
        return await asyncio.to_thread(tokenizer_for, self.repository, self.tokenizer_source, name, version)

    async def max_model_len(self, name: str, version: str) -> int:
        """:func:`max_model_len` of the version, in tokens."""
        return await asyncio.to_thread(max_model_len, self.repository, name, version)

    async def vocab_size(self, name: str, version: str) -> int:
        """:func:`vocab_size` of the version."""
        return await asyncio.to_thread(vocab_size, self.repository, name, version)

    async def card(self, model_id: str) -> dict:
        """The model object of ``/v1/models``: OpenAI's fields and vLLM's ``max_model_len``, which clients size
        their requests by (left out, with a warning, where the repository cannot tell)."""
        entry = {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "triton"}
        name, _, version = model_id.partition("/")
        try:
            entry["max_model_len"] = await self.max_model_len(name, version)
        except Exception as exc:  # noqa: BLE001 - a model whose config cannot be read here
            log.warning("max_model_len of %s unknown to the frontend: %s", model_id, exc)
        return entry


def tokenizer_for(repository: Path, tokenizer: str | None, name: str, version: str):
    """The tokenizer of a model version: ``tokenizer`` (one for every model) if given, else the model's own
    (loaded once, cached; the first load takes seconds: call it off the event loop)."""
    return _load_tokenizer(tokenizer or model_source(repository, name, version))


def model_source(repository: Path, name: str, version: str) -> str:
    """The model a version serves, as its engine reads it: config.pbtxt's ``model`` parameter, then
    ``<version>/engine.json`` (version "" = the newest version directory); "" is the default model."""
    return _setting(repository, name, version, "model") or ""


def max_model_len(repository: Path, name: str, version: str) -> int:
    """The ``max_model_len`` a model version runs with, as its engine reads it: ``<version>/engine.json``
    over config.pbtxt's parameter (version "" = the newest version directory); where neither sets it, the
    model's own, as the engine derives it (``backend.model_support.default_max_model_len``)."""
    value = _setting(repository, name, version, "max_model_len")
    try:
        if value not in (None, ""):
            return int(value)
    except (TypeError, ValueError):
        pass  # the engine refused to load such a value: no request reaches this model
    from backend.model_support import default_max_model_len

    return default_max_model_len(_model_config(model_source(repository, name, version)))


def vocab_size(repository: Path, name: str, version: str) -> int:
    """The size of the vocabulary a model version embeds (its config's ``vocab_size``): token ids at or above it
    are refused by the engine."""
    return _model_config(model_source(repository, name, version)).vocab_size


def _setting(repository: Path, name: str, version: str, key: str):
    """An engine setting of a model version as its engine reads it: ``<version>/engine.json``'s over config.pbtxt's
    parameter (version "" = the newest version directory); None where neither sets it. An empty string or null
    means the setting's default to the engine, and to the callers here."""
    directory = repository / name
    value = None
    config = directory / "config.pbtxt"
    if config.exists():
        match = re.search(rf'key:\s*"{re.escape(key)}"\s*value:\s*\{{\s*string_value:\s*"([^"]*)"', config.read_text())
        value = match[1] if match else None
    versions = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True) \
        if directory.is_dir() else []
    version = version or (str(versions[0]) if versions else "")
    engine = directory / version / "engine.json"
    if version and engine.exists():
        value = json.loads(engine.read_text()).get(key, value)
    return value


@lru_cache(maxsize=8)
def _load_tokenizer(source: str):
    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(source or None))


@lru_cache(maxsize=16)
def _model_config(source: str):
    from transformers import AutoConfig

    from backend.model_loader import resolve_model_dir

    return AutoConfig.from_pretrained(resolve_model_dir(source or None))
