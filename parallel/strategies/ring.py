"""`ring`: K and V travel around the context axis, one `ppermute` of each per step, while each device attends its
local queries to the piece it holds; partial results merge by log-sum-exp in fp32.

Every step is one kernel call over the whole local Q and the piece, causal by global token index (the step against
our own piece by position, the same order, so the kernel knows the diagonal at trace time): the kernel skips
block pairs with nothing visible (the blockwise kernel also builds no mask where all pairs are visible), so in the
dual_chunk layout the steps cost the same on every rank (own piece: the causal diagonal; a piece from a lower
rank: all Q x its first chunk; from a higher rank: our second chunk x all of it) with no branch on the step. The
backward ring sends dK/dV along the same path one step behind K/V, so they arrive back at their owner; each
step's kernel adds its terms into the running dq / dK / dV (in place in the blockwise kernel). dK/dV sum and
travel in float32, or with `plan.ring_grad_dtype="compute"` in K/V's dtype (half the bytes in bfloat16; each
step's terms are still computed in float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel.lse_merge import merge
from parallel.strategies.common import axis_shards, global_index, plan_kernel, run_sharded


def ring_local(q, k, v, seg, *, axis: str, shards: int, index, causal: bool, scale: float, plan):
    """Inside a shard_map over `axis` (shards devices): q [batch, n, heads, dqk], k/v [batch, n, kv_heads, d] and
    seg [batch, n] are this device's piece; index: numpy [shards * n] global token index of every piece in order.
    Returns out [batch, n, heads, dv]."""
    n = q.shape[1]
    table = index.reshape(shards, n)  # numpy: a constant in each traced function (custom_vjp closes over no tracer)
    blocks = dict(scale=scale, block_q=plan.block_q, block_kv=plan.block_kv)
    impl = plan_kernel(plan)

    def grad_dtype(x):
        return jnp.float32 if plan.ring_grad_dtype == "float32" else x.dtype

    to_next = [(i, (i + 1) % shards) for i in range(shards)]

    own = np.arange(n, dtype=np.int32)

    def pieces(kv, seg, seg_all, rank, source):
        """(k, v, kv segment ids, q_index, kv_index) of the step against the piece of `source` (None: our own, whose
        indices are positions: static, so the kernel knows the causal diagonal at trace time; a piece is in
        increasing global order, so causality by position is causality by global index)."""
        if source is None:
            return kv[0], kv[1], seg, own, own
        return kv[0], kv[1], seg_all[source], jnp.asarray(table)[rank], jnp.asarray(table)[source]

    def step_forward(q, seg, kv, seg_all, rank, source):
        """(out float32, lse) of local queries against the KV block of `source` (None: our own)."""
        k_s, v_s, kv_seg, q_index, kv_index = pieces(kv, seg, seg_all, rank, source)
        return impl.forward(q, k_s, v_s, seg, kv_seg, q_index, kv_index, causal=causal, out_dtype=jnp.float32, **blocks)

    def step_backward(q, seg, kv, seg_all, out, lse, dout, rank, source, grads):
        """grads = (dq float32, dk, dv) with the terms of local queries against the KV block of `source` (None: our
        own) added."""
        k_s, v_s, kv_seg, q_index, kv_index = pieces(kv, seg, seg_all, rank, source)
        args = (q, k_s, v_s, seg, kv_seg, q_index, kv_index, out, lse, dout, None)
        return impl.backward(*args, causal=causal, accumulate=grads, **blocks)

    def run_forward(q, kv, seg):
        rank = lax.axis_index(axis)
        seg_all = lax.all_gather(seg, axis)  # [shards, batch, n]: small, so gathered once instead of rotated
        in_flight = lax.ppermute(kv, axis, to_next) if shards > 1 else kv  # issued before step 0's compute
        # The first and the last step are peeled off the scan: the first is the causal diagonal (the local block,
        # no permute to wait for) and its result initialises the merge; the last issues no permute, since no
        # block is needed after it. The scan body is then the same for every middle step: permute, compute, merge.
        out, lse = step_forward(q, seg, kv, seg_all, rank, None)

        def body(carry, i):
            kv, out, lse = carry
            next_kv = lax.ppermute(kv, axis, to_next)
            part = step_forward(q, seg, kv, seg_all, rank, (rank - i) % shards)
            return (next_kv, *merge(out, lse, *part)), None

        if shards > 1:
            (kv_last, out, lse), _ = lax.scan(body, (in_flight, out, lse), jnp.arange(1, shards - 1))
            out, lse = merge(out, lse, *step_forward(q, seg, kv_last, seg_all, rank, (rank + 1) % shards))
        return out.astype(q.dtype), (seg_all, out, lse)

    @jax.custom_vjp
    def ring(q, kv, seg):
        return run_forward(q, kv, seg)[0]

    def ring_fwd(q, kv, seg):
        out, (seg_all, out32, lse) = run_forward(q, kv, seg)
        return out, (q, kv, seg, seg_all, out32, lse)

    def ring_bwd(residuals, dout):
        q, kv, seg, seg_all, out, lse = residuals
        rank = lax.axis_index(axis)
        in_flight = lax.ppermute(kv, axis, to_next) if shards > 1 else kv
        # dq sums in float32; dk and dv sum and travel in grad_dtype; each step's terms are float32
        zeros = (
            jnp.zeros(q.shape, jnp.float32),
            *(jnp.zeros(x.shape, grad_dtype(x)) for x in kv),
        )
        dq, dk, dv = step_backward(q, seg, kv, seg_all, out, lse, dout, rank, None, zeros)

        def body(carry, i):
            kv, dq, dk, dv = carry
            next_kv = lax.ppermute(kv, axis, to_next)
            dk, dv = lax.ppermute((dk, dv), axis, to_next)  # arrive with the K/V they belong to
            grads = step_backward(q, seg, kv, seg_all, out, lse, dout, rank, (rank - i) % shards, (dq, dk, dv))
            return (next_kv, *grads), None

        if shards > 1:
            (kv_last, dq, dk, dv), _ = lax.scan(body, (in_flight, dq, dk, dv), jnp.arange(1, shards - 1))
            dk, dv = lax.ppermute((dk, dv), axis, to_next)
            dq, dk, dv = step_backward(
                q, seg, kv_last, seg_all, out, lse, dout, rank, (rank + 1) % shards, (dq, dk, dv)
            )
            dk, dv = lax.ppermute((dk, dv), axis, to_next)  # home to the owner
        return dq.astype(q.dtype), (dk.astype(kv[0].dtype), dv.astype(kv[1].dtype)), None

    ring.defvjp(ring_fwd, ring_bwd)
    return ring(q, (k, v), seg)


def attention(q, k, v, *, segment_ids, causal, scale, plan, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d] -> [batch, length, heads, dv]."""
    axis, shards = plan.axis, axis_shards(mesh, plan.axis)
    index = global_index(q.shape[1], plan, shards)
    local = functools.partial(ring_local, axis=axis, shards=shards, index=index, causal=causal, scale=scale, plan=plan)
    return run_sharded(local, mesh, axis, q, k, v, segment_ids)
