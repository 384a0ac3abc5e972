"""Values made to wait for an anchor: each passes through one optimization barrier with it, so XLA computes (or
starts sending) it only once the anchor exists. A constant or a ready input otherwise may be scheduled anywhere, e.g.
a backward's zeros and first send at the program's start, live through the whole forward."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def after(anchor, tree):
    """`tree` (any pytree of arrays) as it is, available only once `anchor` is."""
    return lax.optimization_barrier((anchor, tree))[1]


def full(anchor, shape, value, dtype):
    """jnp.full(shape, value, dtype), made only once `anchor` is."""
    return jnp.broadcast_to(after(anchor, jnp.asarray(value, dtype)), shape)
