"""Which models Triton serves under which OpenAI ids, and each one's tokenizer (read from the model repository,
as the engine reads its model)."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from openai_frontend.errors import OpenAIError
from openai_frontend.triton_stream import TritonLLM


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


def tokenizer_for(repository: Path, tokenizer: str | None, name: str, version: str):
    """The tokenizer of a model version: ``tokenizer`` (one for every model) if given, else the model's own
    (loaded once, cached; the first load takes seconds: call it off the event loop)."""
    return _load_tokenizer(tokenizer or model_source(repository, name, version))


def model_source(repository: Path, name: str, version: str) -> str:
    """The model a version serves, as its engine reads it: config.pbtxt's ``model`` parameter, then
    ``<version>/engine.json`` (version "" = the newest version directory); "" is the default model."""
    directory = repository / name
    source = ""
    config = directory / "config.pbtxt"
    if config.exists():
        match = re.search(r'key:\s*"model"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config.read_text())
        source = match[1] if match else ""
    versions = sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True) \
        if directory.is_dir() else []
    version = version or (str(versions[0]) if versions else "")
    engine = directory / version / "engine.json"
    if version and engine.exists():
        source = json.loads(engine.read_text()).get("model", source) or source
    return source


@lru_cache(maxsize=8)
def _load_tokenizer(source: str):
    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(source or None))
