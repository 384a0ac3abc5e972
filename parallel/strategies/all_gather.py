"""`all_gather`: each device gathers K/V over the context axis and attends its local queries to all of them.

The backward pass of each gather is a reduce-scatter of dK / dV. K and V are gathered separately: stacking them
into one collective would copy the whole gathered sequence twice more (stack, then slice for the kernel).

Under cuDNN (whose masks know segments and top-left causality, not global indices) the gathered K/V are put in
original order and each query chunk of the local piece (one, or two in dual_chunk) makes two calls merged by
log-sum-exp: its own keys (the causal diagonal) and every key before the chunk, later keys masked as padding
(all-visible). Other layouts (striped: many chunks per piece) run cuDNN's general kernel (Pallas on GPU), which it
would fall back to for every call anyway.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel import kernels
from parallel.lse_merge import merge
from parallel.reorder import from_balanced
from parallel.strategies.common import axis_shards, global_index, kernel, local_piece, run_sharded, wants_original_order


def attention(q, k, v, *, segment_ids, causal, scale, plan, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d] -> [batch, length, heads, dv]."""
    axis, shards = plan.axis, axis_shards(mesh, plan.axis)
    index = global_index(q.shape[1], plan, shards)
    cudnn, chunked = wants_original_order(plan), plan.layout in ("contiguous", "dual_chunk") or shards == 1
    if cudnn and not chunked:  # striped: no call cuDNN serves, so compile none
        plan = dataclasses.replace(plan, kernel=kernels.general_kernel("cudnn", plan.platform))
    by_chunks = cudnn and chunked
    static = dict(causal=causal, scale=scale, plan=plan)

    def local(q, k, v, seg):
        gathered = [lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v, seg)]
        q_index = local_piece(index, shards, lax.axis_index(axis))
        if by_chunks:
            layout = dict(layout=plan.layout if shards > 1 else "contiguous", axis=1)
            gathered = [from_balanced(x, shards, **layout) for x in gathered]
            chunks = 2 if layout["layout"] == "dual_chunk" else 1
            return chunk_calls(q, k, v, seg, *gathered, q_index, chunks=chunks, **static)
        out, _ = kernel(q, *gathered[:2], seg, gathered[2], q_index, jnp.asarray(index), **static)
        return out

    return run_sharded(local, mesh, axis, q, k, v, segment_ids)


def chunk_calls(q, k, v, seg, k_all, v_all, seg_all, q_index, *, chunks: int, causal, scale, plan):
    """The local piece's attention as calls cuDNN serves. q [batch, n, heads, dqk], k/v [batch, n, kv_heads, d], seg
    [batch, n]: this device's piece, `chunks` runs of consecutive tokens; k_all/v_all [batch, length, ...], seg_all
    [batch, length]: the whole sequence in original order; q_index [n] (traced) global index of the piece.
    -> out [batch, n, heads, dv]."""
    length = k_all.shape[1]
    everything = np.arange(length, dtype=np.int32)
    if not causal:
        piece = np.arange(q.shape[1], dtype=np.int32)  # increasing, as q_index is: only the order matters
        return kernel(q, k_all, v_all, seg, seg_all, piece, everything, causal=False, scale=scale, plan=plan)[0]
    size = q.shape[1] // chunks
    own = np.arange(size, dtype=np.int32)
    outs = []
    for c in range(chunks):
        part = slice(c * size, (c + 1) * size)
        q_c, seg_c = q[:, part], seg[:, part]
        out, lse = kernel(q_c, k[:, part], v[:, part], seg_c, seg_c, own, own, causal=True, scale=scale, plan=plan)
        before = jnp.where(everything < q_index[c * size], seg_all, 0)  # keys after the chunk's first as padding
        prior = kernel(q_c, k_all, v_all, seg_c, before, own, everything, causal=False, scale=scale, plan=plan)
        out, _ = merge(out.astype(jnp.float32), lse, prior[0].astype(jnp.float32), prior[1])
        outs.append(out.astype(q.dtype))
    return jnp.concatenate(outs, axis=1)
