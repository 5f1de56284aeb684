"""The embedded GGUF is converted once per content, not once per path: every clone's virtual environment holds its
own copy of the same file, and they share one converted directory."""

from __future__ import annotations

import shutil

from backend.model_loader import default_gguf_path, gguf_key, resolve_model_dir


def test_a_copy_of_the_gguf_elsewhere_resolves_to_the_same_converted_model(tmp_path, default_model_dir):
    original = default_gguf_path()
    copy = tmp_path / "elsewhere" / original.name
    copy.parent.mkdir()
    shutil.copy(original, copy)
    assert gguf_key(copy) == gguf_key(original)
    assert resolve_model_dir(copy) == default_model_dir  # found in the cache: no second conversion
    changed = tmp_path / "changed.gguf"
    data = bytearray(original.read_bytes())
    data[-1] ^= 1  # the last tensor's last byte
    changed.write_bytes(bytes(data))
    assert gguf_key(changed) != gguf_key(original)
