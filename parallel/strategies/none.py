"""`none`: the local kernel on the whole sequence (no context parallelism); cuDNN where `parallel.fused` allows."""

from __future__ import annotations

import jax.numpy as jnp

from parallel import fused
from parallel.strategies.common import axis_size, global_index, kernel


def attention(q, k, v, *, segment_ids, causal, scale, plan, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d] -> [batch, length, heads, dv]."""
    cp = 1 if plan.layout == "contiguous" else axis_size(mesh, plan.axis)
    if fused.usable(q, k, v, segment_ids=segment_ids, contiguous=cp == 1, enabled=plan.fused):
        return fused.attention(q, k, v, causal=causal, scale=scale)
    index = jnp.asarray(global_index(q.shape[1], plan, cp))
    out, _ = kernel(q, k, v, segment_ids, segment_ids, index, index, causal=causal, scale=scale, plan=plan)
    return out
