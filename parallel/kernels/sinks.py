"""Attention sinks (GPT-OSS): a learned per-head logit that joins every query's softmax denominator as one more key
whose value is zero. Applied once to a finished attention (a kernel's, or a ring's merged pieces), never per piece:
with the keys' lse, softmax over the keys and the sink scales the keys' output by exp(lse) / (exp(lse) + exp(sink))
= sigmoid(lse - sink). Its gradient reaches q, k and v through out and lse, which the kernels differentiate."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply(out, lse, sinks):
    """out [batch, t, heads, dv], lse [batch, t, heads] float32 (the keys' only), sinks [heads] (None: no sink) ->
    out [batch, t, heads, dv] in out's dtype, scaled by sigmoid(lse - sink) (a query with no visible key, lse -inf,
    stays zeros)."""
    if sinks is None:
        return out
    weight = jax.nn.sigmoid(lse - sinks.astype(jnp.float32))
    return (out.astype(jnp.float32) * weight[..., None]).astype(out.dtype)


def local_heads(sinks, axis: str, shards: int):
    """Inside a shard_map: sinks [heads] of this device's heads -> [heads / shards], the slice of the heads a Ulysses
    all-to-all over `axis` (shards devices) gives this device (None stays None)."""
    if sinks is None:
        return None
    return sinks.reshape(shards, -1)[jax.lax.axis_index(axis)]
