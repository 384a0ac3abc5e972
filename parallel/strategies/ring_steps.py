"""What a ring step against another rank's piece can see, fixed at trace time by the layout: every later step is one
of two shapes, chosen by whether the arriving piece comes from a lower or a higher rank (one run-time choice between
two static calls, so no kernel compiles a kind it can never be).

With S ranks and pieces of n tokens:
- dual_chunk (rank r holds chunks r and 2S-1-r): a lower rank's piece is all our queries x its first chunk, a higher
  rank's our second chunk x all of it; both all-visible within segments, n * n/2 pairs either way.
- contiguous (rank r holds chunk r): a lower rank's piece is all-visible, a higher rank's invisible.
- striped (rank r holds stripes r, r+S, ... of `stripe` tokens): our i-th stripe sees a lower rank's stripes j <= i
  and a higher rank's j < i, which causal masks over local stripe numbers express (the higher side's shifted by one).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StepShape(NamedTuple):
    """One ring step's static call: our query rows `queries` x the arriving piece's key rows `keys`, masked by the
    static indices `q_index` [len(queries)] / `kv_index` [len(keys)] when `causal` (else all-visible within
    segments)."""

    queries: slice
    keys: slice
    q_index: np.ndarray
    kv_index: np.ndarray
    causal: bool


def step_shapes(layout: str, n: int, stripe: int, causal: bool) -> tuple[StepShape | None, StepShape | None]:
    """(from a lower rank, from a higher rank) for pieces of n tokens in `layout` (non-causal: every piece whole,
    all-visible); None where nothing is visible."""
    whole, first, second = slice(0, n), slice(0, n // 2), slice(n // 2, n)
    if not causal:
        return _visible(whole, whole, n), _visible(whole, whole, n)
    if layout == "dual_chunk":
        return _visible(whole, first, n), _visible(second, whole, n)
    if layout == "contiguous":
        return _visible(whole, whole, n), None
    if layout == "striped":
        stripes = np.arange(n, dtype=np.int32) // stripe
        return StepShape(whole, whole, stripes, stripes, True), StepShape(whole, whole, stripes, stripes + 1, True)
    raise ValueError(f"sequence layout {layout!r} has no ring steps; available: contiguous, dual_chunk, striped")


def _visible(queries: slice, keys: slice, n: int) -> StepShape:
    """All of `queries` x `keys` visible within segments (indices: positions, unused by a non-causal call)."""
    return StepShape(queries, keys, np.arange(n, dtype=np.int32)[queries], np.arange(n, dtype=np.int32)[keys], False)
