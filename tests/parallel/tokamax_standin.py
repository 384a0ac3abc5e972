"""A dense stand-in for tokamax's attention calls (parallel.kernels.tokamax_attention.Library), for CPU tests.

Same operands, keywords and results: q [b, tq, h, dqk], k [b, tk, hk, dqk], v [b, tk, hk, dv], k_start / k_end
[b, tq] int32 (query i sees keys k_start[i] <= j < k_end[i]); the forward returns out and the rows' (max, sum) of
exp [b, h, tq] (max -inf and sum 0 where a query sees nothing, out 0); the backward takes those (max, sum), out and
dout and computes delta = rowsum(dout * out) from out, as tokamax's VJP kernel does. Query head i reads key head
i // (h / hk). Ranges past the keys poison every output with NaN, as would reading outside them.
"""

import jax.numpy as jnp

from parallel.kernels import tokamax_attention


def _scores(q, k, k_start, k_end, scale):
    """(scores [b, h, tq, tk] float32 with -inf outside each query's range, mask [b, 1, tq, tk], poison: 0 or NaN)."""
    group = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, group, axis=2).astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision="highest") * scale
    keys = jnp.arange(k.shape[1])
    mask = (keys >= k_start[..., None]) & (keys < k_end[..., None])
    ok = jnp.all((k_start >= 0) & (k_end <= k.shape[1]))
    return jnp.where(mask[:, None], s, -jnp.inf), mask[:, None], jnp.where(ok, 0.0, jnp.nan)


def forward(q, k, v, k_start, k_end, *, scale):
    s, mask, poison = _scores(q, k, k_start, k_end, scale)
    top = jnp.max(s, -1)
    shifted = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0)[..., None]), 0.0)
    total = jnp.sum(shifted, -1)
    group = q.shape[2] // k.shape[2]
    v = jnp.repeat(v, group, axis=2).astype(jnp.float32)
    out = jnp.einsum("bhqk,bkhd->bqhd", shifted / jnp.where(total > 0, total, 1.0)[..., None], v, precision="highest")
    return (out + poison).astype(q.dtype), (top + poison, total + poison)


def backward(q, k, v, residuals, out, dout, k_start, k_end, *, scale):
    top, total = residuals
    s, mask, poison = _scores(q, k, k_start, k_end, scale)
    p = jnp.where(mask, jnp.exp(s - top[..., None]) / total[..., None], 0.0)
    group = q.shape[2] // k.shape[2]
    f32 = lambda x: x.astype(jnp.float32)
    dp = jnp.einsum("bqhd,bkhd->bhqk", f32(dout), jnp.repeat(f32(v), group, axis=2), precision="highest")
    delta = jnp.einsum("bqhd,bqhd->bhq", f32(dout), f32(out), precision="highest")
    ds = p * (dp - delta[..., None]) * scale + poison
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, jnp.repeat(f32(k), group, axis=2), precision="highest")

    def per_kv_head(x):
        """[b, tk, h, d] -> [b, tk, hk, d] summed over each group."""
        return x.reshape(*x.shape[:2], k.shape[2], group, x.shape[-1]).sum(3)

    dk = per_kv_head(jnp.einsum("bhqk,bqhd->bkhd", ds, f32(q), precision="highest"))
    dv = per_kv_head(jnp.einsum("bhqk,bqhd->bkhd", p, f32(dout), precision="highest"))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


STANDIN = tokamax_attention.Library(forward, backward)
