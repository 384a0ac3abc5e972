"""`usp`: Ulysses over one mesh axis inside ring over another (heads x sequence). The sequence is sharded over
(ring axis, ulysses axis); a Ulysses all-to-all assembles each ring rank's piece, which the ring then treats
as its local block, load-balanced when the layout is dual_chunk over the ring size."""

from __future__ import annotations

from parallel.strategies.common import axis_shards, global_index, run_sharded
from parallel.strategies.ring import ring_local
from parallel.strategies.ulysses import check_heads, gather_heads, scatter_heads


def attention(q, k, v, *, segment_ids, causal, scale, plan, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d] -> [batch, length, heads, dv].
    plan.axis = (ring axis, ulysses axis)."""
    if isinstance(plan.axis, str) or len(plan.axis) != 2:
        raise ValueError(f"usp needs axis=(ring axis, ulysses axis), got {plan.axis!r}")
    ring_axis, ulysses_axis = plan.axis
    ring_shards, ulysses_shards = axis_shards(mesh, ring_axis), axis_shards(mesh, ulysses_axis)
    check_heads(q.shape[2], k.shape[2], ulysses_shards, ulysses_axis)
    index = global_index(q.shape[1], plan, ring_shards)

    def local(q, k, v, seg):
        q, k, v, seg = scatter_heads(q, k, v, seg, ulysses_axis, ulysses_shards)
        out = ring_local(
            q, k, v, seg, axis=ring_axis, shards=ring_shards, index=index, causal=causal, scale=scale, plan=plan
        )
        return gather_heads(out, ulysses_axis)

    return run_sharded(local, mesh, plan.axis, q, k, v, segment_ids)
