"""Merging partial attentions over disjoint key sets by their log-sum-exp (ring steps, split calls, halos)."""

from __future__ import annotations

import jax.numpy as jnp


def merge(out_a, lse_a, out_b, lse_b):
    """Combines two partial attentions over disjoint keys: out [..., dv] float32, lse [...]; safe, differentiated
    too, when both lse are -inf (no visible key on either side: stays zeros / -inf, with zero gradients)."""
    top = jnp.maximum(lse_a, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out = (out_a * weight_a[..., None] + out_b * weight_b[..., None]) / total[..., None]
    return out, jnp.where(seen, top + jnp.log(total), -jnp.inf)
