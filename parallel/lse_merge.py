"""Merging partial attentions over disjoint key sets by their log-sum-exp (ring steps, split calls, halos)."""

from __future__ import annotations

import jax.numpy as jnp

from parallel.kernels.softmax import finish_lse, safe_shift


def merge(out_a, lse_a, out_b, lse_b):
    """Combines two partial attentions over disjoint keys: out [..., dv] float32, lse [...]; safe, differentiated
    too, when both lse are -inf (no visible key on either side: stays zeros / -inf, with zero gradients)."""
    top = safe_shift(jnp.maximum(lse_a, lse_b))
    weight_a, weight_b = jnp.exp(lse_a - top), jnp.exp(lse_b - top)
    total = weight_a + weight_b
    out = (out_a * weight_a[..., None] + out_b * weight_b[..., None]) / jnp.where(total > 0, total, 1.0)[..., None]
    return out, finish_lse(top, total)
