"""`all_gather`: each device gathers K/V over the context axis and attends its local queries to all of them.

The backward pass of each gather is a reduce-scatter of dK / dV. K and V are gathered separately: stacking them
into one collective would copy the whole gathered sequence twice more (stack, then slice for the kernel).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from parallel.strategies.common import axis_shards, global_index, kernel, local_piece, run_sharded


def attention(q, k, v, *, segment_ids, causal, scale, plan, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d] -> [batch, length, heads, dv]."""
    axis, shards = plan.axis, axis_shards(mesh, plan.axis)
    index = global_index(q.shape[1], plan, shards)

    def local(q, k, v, seg):
        k, v, kv_seg = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v, seg))
        q_index = local_piece(index, shards, lax.axis_index(axis))
        out, _ = kernel(q, k, v, seg, kv_seg, q_index, jnp.asarray(index), causal=causal, scale=scale, plan=plan)
        return out

    return run_sharded(local, mesh, axis, q, k, v, segment_ids)
