"""Load-balanced layouts of the sequence axis for causal context parallelism, forward and inverse.

Static reshapes, slices, flips and transposes only (no gather); numpy in gives numpy out, jax in gives jax out.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

LAYOUTS = ("contiguous", "dual_chunk", "striped")


def _check(x, cp: int, axis: int, layout: str, stripe: int) -> int:
    """Validates the arguments for `x`; returns `axis` as a non-negative index."""
    if layout not in LAYOUTS:
        raise ValueError(f"sequence layout {layout!r} is unknown; available: {', '.join(LAYOUTS)}")
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    if stripe < 1:
        raise ValueError(f"stripe={stripe} must be >= 1")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of {x.ndim} dimensions")
    axis %= x.ndim
    length = x.shape[axis]
    if layout == "dual_chunk" and length % (2 * cp):
        raise ValueError(f"sequence length {length} is not divisible by 2*cp={2 * cp} for dual_chunk layout")
    if layout == "striped" and length % (cp * stripe):
        raise ValueError(f"sequence length {length} is not divisible by cp*stripe={cp * stripe} for striped layout")
    return axis


def _unfold(x, axis: int, sizes: tuple[int, ...]):
    """Splits dimension `axis` of `x` into dimensions `sizes` (their product is x.shape[axis])."""
    return x.reshape(x.shape[:axis] + sizes + x.shape[axis + 1 :])


def _fold(x, axis: int):
    """Merges dimensions `axis` .. `axis`+2 of `x` into one (inverse of a three-way `_unfold`)."""
    return x.reshape((*x.shape[:axis], -1, *x.shape[axis + 3 :]))


def _reorder(x, cp: int, axis: int, layout: str, stripe: int, forward: bool):
    """x: [..., length (at axis), ...] -> same shape, sequence axis permuted to or from `layout`."""
    axis = _check(x, cp, axis, layout, stripe)
    if layout == "contiguous" or cp == 1:
        return x
    xp = np if isinstance(x, np.ndarray) else jnp
    length = x.shape[axis]
    if layout == "striped":
        # [stripes per rank, cp, stripe] <-> [cp, stripes per rank, stripe]
        rows = length // (cp * stripe)
        sizes = (rows, cp, stripe) if forward else (cp, rows, stripe)
        return _fold(xp.swapaxes(_unfold(x, axis, sizes), axis, axis + 1), axis)
    # dual_chunk: chunks [2*cp, 1, chunk]; forward sets the first half and the reversed second half side by
    # side -> [cp, 2, chunk]; inverse splits those columns and stacks them back in the same way.
    chunk = length // (2 * cp)
    sizes, halves, join = ((2 * cp, 1, chunk), axis, axis + 1) if forward else ((cp, 2, chunk), axis + 1, axis)
    first, second = xp.split(_unfold(x, axis, sizes), 2, axis=halves)
    return _fold(xp.concatenate([first, xp.flip(second, axis=axis)], axis=join), axis)


def to_balanced(x, cp: int, *, axis: int = 1, layout: str = "dual_chunk", stripe: int = 1):
    """x: [..., length (at axis), ...] in original order -> same shape in the `layout` layout."""
    return _reorder(x, cp, axis, layout, stripe, forward=True)


def from_balanced(x, cp: int, *, axis: int = 1, layout: str = "dual_chunk", stripe: int = 1):
    """x: [..., length (at axis), ...] in the `layout` layout -> same shape in original order."""
    return _reorder(x, cp, axis, layout, stripe, forward=False)


def layout_index(length: int, cp: int, layout: str, stripe: int = 1) -> np.ndarray:
    """int32 [length]: the original token index at each position of `layout`."""
    return to_balanced(np.arange(length, dtype=np.int32), cp, axis=0, layout=layout, stripe=stripe)
