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
