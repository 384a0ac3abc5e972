"""Explicit-mask fp32 attention with log-sum-exp: the reference for the kernel and every strategy."""

import jax
import jax.numpy as jnp
import numpy as np


def reference(q, k, v, *, segment_ids=None, causal=True, scale=None, window=None, sinks=None):
    """q [b, t, h, dqk], k [b, t, hkv, dqk], v [b, t, hkv, dv] in original order
    -> (out [b, t, h, dv], lse [b, t, h]). window W: query i sees keys i - W < j <= i; sinks [h]: one more logit
    column per head whose value is zero (lse stays the keys' only)."""
    b, t, h, dqk = q.shape
    group = h // k.shape[2]
    scale = dqk**-0.5 if scale is None else scale
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    mask = jnp.ones((b, t, t), bool)
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0)
    if causal:
        mask &= jnp.tril(jnp.ones((t, t), bool))
    if window is not None:
        mask &= ~jnp.tril(jnp.ones((t, t), bool), -window)
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    if sinks is not None:  # a column of logits whose value is zero
        scores = jnp.concatenate([scores, jnp.broadcast_to(sinks[None, :, None, None], (*scores.shape[:3], 1))], -1)
        mask = jnp.concatenate([mask, jnp.ones((b, t, 1), bool)], axis=-1)
        v = jnp.concatenate([v, jnp.zeros((b, 1, *v.shape[2:]), v.dtype)], axis=1)
    total = jax.nn.logsumexp(scores, axis=-1)
    weights = jnp.where(mask[:, None], jnp.exp(scores - jnp.where(jnp.isfinite(total), total, 0.0)[..., None]), 0.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v, precision="highest")
    return out, jnp.swapaxes(lse, 1, 2)


def packed_segments(batch: int, length: int, seed: int = 0) -> np.ndarray:
    """int32 [batch, length]: random documents with padding inside and at the end; the last row all padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, length), np.int32)
    for row in range(batch - 1):
        pos, doc = 0, 1
        while pos < length:
            size = int(rng.integers(1, max(2, length // 3)))
            if rng.random() < 0.2:
                pos += size  # a padding gap
                continue
            seg[row, pos : pos + size] = doc
            pos, doc = pos + size, doc + 1
        seg[row, -int(rng.integers(1, 4)) :] = 0
    return seg


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|."""
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(np.asarray(actual, np.float64) - expected)) / max(np.max(np.abs(expected)), 1e-30))
