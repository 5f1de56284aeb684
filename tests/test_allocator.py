"""serve.allocator: which library the engine's process preloads, on a stand-in library directory."""

from __future__ import annotations

import pytest

from serve import allocator


def test_tcmalloc_is_preloaded_where_installed_and_refused_clearly_where_asked_for_but_missing(tmp_path):
    library = tmp_path / "x86_64-linux-gnu" / "libtcmalloc_minimal.so.4"
    library.parent.mkdir()
    library.write_bytes(b"")
    pattern = str(tmp_path / "*-linux-gnu" / "libtcmalloc_minimal.so.4")
    env, said = allocator.preload({"LD_PRELOAD": "/opt/other.so", "HOME": "/root"}, "auto", pattern)
    assert env["LD_PRELOAD"] == f"{library}:/opt/other.so" and said == f"tcmalloc ({library})"
    again, _ = allocator.preload(env, "tcmalloc", pattern)
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"]  # never twice
    assert allocator.without(env, str(library)) == {"LD_PRELOAD": "/opt/other.so", "HOME": "/root"}
    assert allocator.without({"LD_PRELOAD": str(library)}, str(library)) == {}
    plain, said = allocator.preload({"HOME": "/root"}, "system", pattern)
    assert plain == {"HOME": "/root"} and said == "glibc malloc"
    missing = str(tmp_path / "none" / "libtcmalloc_minimal.so.4")
    plain, said = allocator.preload({}, "auto", missing)
    assert plain == {} and "not installed" in said
    with pytest.raises(FileNotFoundError, match="libtcmalloc-minimal4"):
        allocator.preload({}, "tcmalloc", missing)
    with pytest.raises(ValueError, match="malloc must be one of"):
        allocator.preload({}, "jemalloc", pattern)
