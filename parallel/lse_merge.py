"""Merging partial attentions over disjoint key sets by their log-sum-exp (ring steps, split calls)."""

from __future__ import annotations

import jax.numpy as jnp


def merge(out_a, lse_a, out_b, lse_b):
    """Combines two partial attentions over disjoint keys: out [..., dv] float32, lse [...]; safe when both
    lse are -inf (no visible key on either side: stays zeros / -inf)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return out_a * jnp.exp(lse_a - safe)[..., None] + out_b * jnp.exp(lse_b - safe)[..., None], lse
