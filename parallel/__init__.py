"""Everything that knows about devices: mesh and axis rules, attention strategies, sharding constraints.

Models and layers call `parallel.attention` and `parallel.shard` with logical names only.
"""

from __future__ import annotations

import jax

from parallel.dense import dense_attention
from parallel.mesh import logical_spec

STRATEGIES = {"none": dense_attention}


def attention(q, k, v, *, segment_ids=None, causal=True, scale=None, strategy="none"):
    """Attention over the sequence; q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d]
    -> [batch, length, heads, dv]. `segment_ids` [batch, length] (0 = padding) restricts attention to one
    document; causality refers to the original token order."""
    if strategy not in STRATEGIES:
        raise ValueError(f"attention strategy {strategy!r} is unknown; available: {', '.join(STRATEGIES)}")
    return STRATEGIES[strategy](q, k, v, segment_ids=segment_ids, causal=causal, scale=scale)


def shard(x, names):
    """Constrains activation `x` to the sharding of its logical axis names when a mesh is set; else no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(names, mesh))
