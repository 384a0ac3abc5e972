"""Sizes rounded up: ceil division and the next multiple (blocks, padded widths, rows per shard)."""

from __future__ import annotations


def ceil_div(n: int, d: int) -> int:
    """ceil(n / d) for integers, d > 0."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least n."""
    return ceil_div(n, multiple) * multiple
