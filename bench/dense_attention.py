"""Dense masked attention, O(T²) memory: the baseline bench/attention.py measures the kernels against (the tests
have their own fp32 reference, tests/parallel/attention_reference.py)."""

from __future__ import annotations

import jax.numpy as jnp


def attention_mask(q_segment_ids, kv_segment_ids, *, causal: bool, length_q: int, length_kv: int):
    """Boolean mask [batch, length_q, length_kv]: same non-zero segment and, if causal, key index <= query index."""
    if q_segment_ids is None:
        mask = jnp.ones((1, length_q, length_kv), bool)
    else:
        mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] > 0)
    if causal:
        mask &= jnp.arange(length_q)[:, None] >= jnp.arange(length_kv)[None, :]
    return mask


def dense_attention(q, k, v, *, segment_ids=None, causal=True, scale=None):
    """Softmax attention with an explicit mask; fully masked rows give zeros.

    q: [batch, length, heads, dqk], k: [batch, length, kv_heads, dqk], v: [batch, length, kv_heads, dv]
    -> [batch, length, heads, dv]. Scores and softmax in float32.
    """
    batch, length, heads, dqk = q.shape
    kv_heads = k.shape[2]
    scale = dqk**-0.5 if scale is None else scale
    qg = q.reshape(batch, length, kv_heads, heads // kv_heads, dqk)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    mask = attention_mask(segment_ids, segment_ids, causal=causal, length_q=length, length_kv=k.shape[1])
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(batch, length, heads, v.shape[-1]).astype(q.dtype)
