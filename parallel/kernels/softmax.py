"""A softmax row's statistics as every attention kernel computes them: the shift that keeps exp from NaN on a row
without a visible key, the log-sum-exp finished from a running (maximum, sum), and the backward's delta."""

from __future__ import annotations

import jax.numpy as jnp


def safe_shift(top):
    """`top` (a row's maximum score or its log-sum-exp) where finite, else 0: what scores are shifted by before exp,
    so a row that sees no key (-inf) gives exp(-inf) = 0, never exp(-inf - -inf) = NaN."""
    return jnp.where(jnp.isfinite(top), top, 0.0)


def finish_lse(top, total):
    """The log-sum-exp top + log(total) of a row from its maximum `top` and total = sum exp(s - top); -inf where the
    total is 0 (no visible key), with no NaN in value or gradient."""
    seen = total > 0
    return jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def backward_delta(out, dout, dlse=None):
    """The backward's per-row term of d score = p (dp - delta): delta = dout . out over the last axis, in float32,
    minus the lse's cotangent `dlse` when the lse is an output too (d lse / d score = p)."""
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    return delta if dlse is None else delta - dlse
