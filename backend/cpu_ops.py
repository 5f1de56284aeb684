"""The one place the C++ CPU kernels (``kernels/cpu``) are imported; everything in ``backend`` reaches them here.

``cpu_ops.rms_norm(...)``, ``cpu_ops.paged_decode_attention(...)`` and every other public function of
``kernels.cpu`` are looked up from that package on first use and then bound in this module, so a call costs a
plain attribute read. ``kernels.cpu`` imports ``kernels``, and with it Triton, so nothing here runs at import.
Which code uses these kernels is decided once, by the attention backend the selector picks
(:mod:`backend.attention.selector`): the ``cpu`` backend and the layers built for it.
"""

from __future__ import annotations


def available() -> bool:
    """Whether the extension is built or builds here (the first call compiles it, about 25 s on 2 cores)."""
    import kernels.cpu

    return kernels.cpu.load() is not None


def __getattr__(name: str):
    """``kernels.cpu.<name>``, bound here on first use.

    Raises:
        AttributeError: ``kernels.cpu`` has no public ``name``.
    """
    if name.startswith("_"):
        raise AttributeError(name)
    import kernels.cpu

    value = getattr(kernels.cpu, name)
    globals()[name] = value
    return value
