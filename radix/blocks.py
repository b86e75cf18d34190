"""Block arithmetic shared by the manager, the scheduler and the worker."""

from __future__ import annotations


def cdiv(n: int, d: int) -> int:
    """ceil(n / d) for ints, d > 0: e.g. the blocks of d tokens that n tokens fill (the last one partly). O(1)."""
    return -(-n // d)
