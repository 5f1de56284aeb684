"""The engine's layers talk through the step's data: lower modules never import the ones that drive them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BACKEND = Path(__file__).resolve().parents[1] / "backend"


def imports(module: str) -> set[str]:
    tree = ast.parse((BACKEND / f"{module}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("module, forbidden", [
    ("model_runner", {"backend.scheduler", "backend.kv_cache_manager", "backend.block_pool", "backend.llm_engine"}),
    ("kv_cache_manager", {"backend.scheduler", "backend.model_runner", "torch"}),
    ("block_pool", {"backend.request", "backend.kv_cache_manager", "torch"}),
    ("scheduler", {"backend.model_runner", "backend.output_processor", "torch"}),
    ("engine_core", {"backend.output_processor", "backend.detokenizer"}),
    ("output_processor", {"backend.scheduler", "backend.kv_cache_manager", "backend.model_runner"}),
])
def test_module_does_not_import_the_layers_above_or_beside_it(module, forbidden):
    assert not imports(module) & forbidden


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_cpu_kernels_are_imported_only_by_their_loader():
    """``kernels.cpu`` is reached through ``backend/cpu_ops.py`` alone: which code runs it is the attention
    backend's choice, made once, not a lazy import at each call site."""
    root = BACKEND.parent
    sources = [p for folder in ("backend", "model_repository", "openai_frontend", "serve")
               for p in (root / folder).rglob("*.py")]
    assert len(sources) > 20
    importers = sorted(str(p.relative_to(root)) for p in sources
                       if any(name == "kernels.cpu" or name.startswith("kernels.cpu.") for name in _imported_modules(p)))
    assert importers == ["backend/cpu_ops.py"]


def test_model_code_calls_one_attention_function():
    """The compact decoder never asks which kernel runs: it imports ``attention`` and no backend or kernel."""
    names = _imported_modules(BACKEND / "models" / "llama.py")
    assert "backend.attention.attention" in names
    assert not {n for n in names if n.startswith("kernels") or n.startswith("backend.attention.")
                and n.split(".")[2] in ("cpu", "torch_sdpa", "triton", "selector")}


def test_the_engine_facade_reaches_the_core_only_through_its_methods():
    """``LLMEngine`` neither keeps nor reads the core's parts: the scheduler, the KV cache manager (and its
    pool) and the model runner belong to the stepping thread, behind ``EngineCore``'s methods; tests and tools
    inspect them through ``debug_snapshot``."""
    tree = ast.parse((BACKEND / "llm_engine.py").read_text())
    parts = {"scheduler", "kv_cache_manager", "model_runner", "pool"}
    reached = sorted({ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and node.attr in parts and not ast.unparse(node.value).endswith("config")})  # settings
    assert reached == []
    from backend.llm_engine import LLMEngine

    assert not parts & set(dir(LLMEngine))
