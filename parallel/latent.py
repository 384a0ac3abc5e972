"""MLA's compressed keys and values, which a ring rotates in place of K/V (DeepSeek-V2/V3: 576 values a token where
K/V hold heads x (192 + 128)): each step expands the arriving latent to K/V on the device that attends, and the
gradient of the latent travels back the way dK/dV do. Models pass it to `parallel.attention` beside K/V; the
strategies that do not rotate K/V ignore it (and XLA drops whichever of the two goes unused)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from parallel.tensor import Tokens


class Latent(NamedTuple):
    """tokens: `parallel.gather`'s grouped tokens [group, batch, length, kv_lora + rope], the normed latent then the
    rotated key part shared by every head; kv_b [kv_lora, heads, nope + dv] (heads as the query's) in the compute
    dtype; nope: the width of each head's key part that kv_b makes (the rest of kv_b's output is the value)."""

    tokens: Tokens
    kv_b: jax.Array
    nope: int


def expand(kv_b: jax.Array, rows: jax.Array, nope: int) -> tuple[jax.Array, jax.Array]:
    """kv_b [kv_lora, heads, nope + dv], rows [batch, n, kv_lora + rope] -> (k [batch, n, heads, nope + rope],
    v [batch, n, heads, dv]): K/V of the rows for kv_b's heads, as the model makes them."""
    lora, heads = kv_b.shape[:2]
    kv = jnp.einsum("bnr,rhd->bnhd", rows[..., :lora], kv_b)
    shared = jnp.broadcast_to(rows[:, :, None, lora:], (*rows.shape[:2], heads, rows.shape[-1] - lora))
    return jnp.concatenate([kv[..., :nope], shared], axis=-1), kv[..., nope:]
