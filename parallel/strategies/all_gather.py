"""`all_gather`: each device gathers K/V over the context axis and attends its local queries to all of them.

K and V travel as one array; the backward pass of the gather is a reduce-scatter of dK/dV.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from parallel.strategies.common import axis_size, global_index, kernel, local_piece, run_sharded


def attention(q, k, v, *, segment_ids, causal, scale, plan, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d] -> [batch, length, heads, dv]."""
    axis, cp, dqk = plan.axis, axis_size(mesh, plan.axis), k.shape[-1]
    index = global_index(q.shape[1], plan, cp)

    def local(q, k, v, seg):
        kv = lax.all_gather(jnp.concatenate([k, v], axis=-1), axis, axis=1, tiled=True)
        kv_seg = lax.all_gather(seg, axis, axis=1, tiled=True)
        q_index = local_piece(index, cp, lax.axis_index(axis))
        out, _ = kernel(q, kv[..., :dqk], kv[..., dqk:], seg, kv_seg, q_index, jnp.asarray(index), causal=causal,
                        scale=scale, plan=plan)
        return out

    return run_sharded(local, mesh, axis, q, k, v, segment_ids)
