"""KV cache events decoded by vLLM's own event classes, taken from the pinned release's wheel.

The test downloads ``vllm==0.32.0`` (no dependencies; cached under ``build/``), reads its
``vllm/distributed/kv_events.py`` and executes that release's own definitions of ``EventBatch``,
``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` and ``KVEventBatch`` (the module's other
imports, vLLM's config and logger, are not needed by these msgspec structs). Every batch a running engine publishes
must decode strictly with them, to the same values as the mirror in ``vllm_kv_schema`` that the fast tests use.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_kv_events import events_engine, run_workload  # noqa: F401  (the fixture)
from vllm_kv_schema import DECODER as MIRROR
from vllm_kv_schema import receive_all

pytestmark = pytest.mark.slow

VLLM = "vllm==0.32.0"
WHEEL_DIR = Path(__file__).resolve().parent.parent / "build" / "vllm-wheel"
CLASSES = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")


@pytest.fixture(scope="module")
def vllm_event_classes() -> dict[str, type]:
    wheels = sorted(WHEEL_DIR.glob("vllm-0.32.0-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", VLLM, "-d", str(WHEEL_DIR)],
                       check=True, timeout=900)
        wheels = sorted(WHEEL_DIR.glob("vllm-0.32.0-*.whl"))
    with zipfile.ZipFile(wheels[0]) as wheel:
        source = wheel.read("vllm/distributed/kv_events.py").decode()
    tree = ast.parse(source)
    wanted = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in CLASSES
              or isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) and t.id.startswith("MEDIUM")
                                                      for t in node.targets)]
    assert {n.name for n in wanted if isinstance(n, ast.ClassDef)} == set(CLASSES), "the release's classes moved"
    module = types.ModuleType("vllm_kv_events_0_32")  # msgspec resolves annotations in the class's module
    module.__dict__.update(msgspec=msgspec, Any=Any, ExternalBlockHash=bytes | int)
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(body=wanted, type_ignores=[]), "vllm/distributed/kv_events.py", "exec"), module.__dict__)
    return {name: getattr(module, name) for name in CLASSES}


def test_vllm_0_32_classes_decode_every_published_batch(events_engine, vllm_event_classes):  # noqa: F811
    engine, subscriber = events_engine
    run_workload(engine)
    decoder = msgspec.msgpack.Decoder(type=vllm_event_classes["KVEventBatch"])
    messages = receive_all(subscriber)
    assert messages
    kinds = set()
    for _, _, payload in messages:
        batch = decoder.decode(payload)  # strict: raises on any field of the wrong type or an unknown tag
        kinds |= {type(event).__name__ for event in batch.events}
        assert msgspec.to_builtins(batch) == msgspec.to_builtins(MIRROR.decode(payload))
    assert kinds == {"BlockStored", "BlockRemoved"}
