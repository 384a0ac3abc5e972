"""The gated delta rule token by token, the reference of parallel/kernels/gated_delta.py: float32 (float64 given
float64), the state reset where the segment id changes (and at the row's start)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def recurrence(q, k, v, g, beta, seg):
    """q, k: [batch, length, heads, dk], v: [batch, length, heads, dv], g / beta: [batch, length, heads], seg:
    [batch, length] -> o [batch, length, heads, dv] float32 (float64 given float64), o_t = S_t^T q_t with
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T and S_{t-1} = 0 where a document starts."""
    dtype = jnp.result_type(jnp.float32, q.dtype, k.dtype, v.dtype)
    q, k, v, g, beta = (x.astype(dtype) for x in (q, k, v, g, beta))
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)

    def step(s, token):
        q_t, k_t, v_t, g_t, beta_t, start = token
        s = jnp.where(start[:, None, None, None], 0.0, s) * jnp.exp(g_t)[..., None, None]
        delta = beta_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t))
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    batch, _, heads, dk = k.shape
    state = jnp.zeros((batch, heads, dk, v.shape[-1]), dtype)
    tokens = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, starts))
    _, out = lax.scan(step, state, tokens)
    return jnp.moveaxis(out, 0, 1)
