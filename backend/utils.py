"""Small arithmetic shared by the KV cache manager and the model runner."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints: how many blocks of ``b`` tokens hold ``a`` tokens."""
    return -(-a // b)
