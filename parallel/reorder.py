"""Load-balanced layouts of the sequence axis for causal context parallelism, forward and inverse.

Static reshapes, slices, flips and transposes only (no gather); numpy in gives numpy out, jax in gives jax out.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "dual_chunk", "striped")


def _check(x, shards: int, axis: int, layout: str, stripe: int) -> int:
    """Validates the arguments for `x`; returns `axis` as a non-negative index."""
    if layout not in LAYOUTS:
        raise ValueError(f"sequence layout {layout!r} is unknown; available: {', '.join(LAYOUTS)}")
    if shards < 1:
        raise ValueError(f"shards={shards} must be >= 1")
    if stripe < 1:
        raise ValueError(f"stripe={stripe} must be >= 1")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of {x.ndim} dimensions")
    axis %= x.ndim
    length = x.shape[axis]
    if layout == "dual_chunk" and length % (2 * shards):
        raise ValueError(f"sequence length {length} is not divisible by 2*shards={2 * shards} for dual_chunk layout")
    if layout == "striped" and length % (shards * stripe):
        raise ValueError(
            f"sequence length {length} is not divisible by shards*stripe={shards * stripe} for striped layout"
        )
    return axis


def _unfold(x, axis: int, sizes: tuple[int, ...]):
    """Splits dimension `axis` of `x` into dimensions `sizes` (their product is x.shape[axis])."""
    return x.reshape(x.shape[:axis] + sizes + x.shape[axis + 1 :])


def _fold(x, axis: int):
    """Merges dimensions `axis` .. `axis`+2 of `x` into one (inverse of a three-way `_unfold`)."""
    return x.reshape((*x.shape[:axis], -1, *x.shape[axis + 3 :]))


def _reorder(x, shards: int, axis: int, layout: str, stripe: int, forward: bool):
    """x: [..., length (at axis), ...] -> same shape, sequence axis permuted to or from `layout`."""
    axis = _check(x, shards, axis, layout, stripe)
    if layout == "contiguous" or shards == 1:
        return x
    xp = np if isinstance(x, np.ndarray) else jnp
    length = x.shape[axis]
    if layout == "striped":
        # [stripes per rank, shards, stripe] <-> [shards, stripes per rank, stripe]
        rows = length // (shards * stripe)
        sizes = (rows, shards, stripe) if forward else (shards, rows, stripe)
        return _fold(xp.swapaxes(_unfold(x, axis, sizes), axis, axis + 1), axis)
    # dual_chunk: chunks [2*shards, 1, chunk]; forward sets the first half and the reversed second half side by
    # side -> [shards, 2, chunk]; inverse splits those columns and stacks them back in the same way.
    chunk = length // (2 * shards)
    sizes, halves, join = ((2 * shards, 1, chunk), axis, axis + 1) if forward else ((shards, 2, chunk), axis + 1, axis)
    first, second = xp.split(_unfold(x, axis, sizes), 2, axis=halves)
    return _fold(xp.concatenate([first, xp.flip(second, axis=axis)], axis=join), axis)


def to_balanced(x, shards: int, *, axis: int = 1, layout: str = "dual_chunk", stripe: int = 1):
    """x: [..., length (at axis), ...] in original order -> same shape in the `layout` layout."""
    return _reorder(x, shards, axis, layout, stripe, forward=True)


def from_balanced(x, shards: int, *, axis: int = 1, layout: str = "dual_chunk", stripe: int = 1):
    """x: [..., length (at axis), ...] in the `layout` layout -> same shape in original order."""
    return _reorder(x, shards, axis, layout, stripe, forward=False)


def layout_index(length: int, shards: int, layout: str, stripe: int = 1) -> np.ndarray:
    """int32 [length]: the original token index at each position of `layout`."""
    return to_balanced(np.arange(length, dtype=np.int32), shards, axis=0, layout=layout, stripe=stripe)
