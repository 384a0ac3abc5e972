"""`ring`: K and V, stacked into one array, travel around the context axis with one `ppermute` per step while
each device attends its local queries to the block it holds; partial results merge by log-sum-exp in fp32.

With causal masking in the dual_chunk layout every step costs the same on every rank (step table):
step 0 (own block): local Q x local KV, causal; source < rank: all Q x first half of KV; source > rank:
second half of Q x all KV. Other layouts attend all of Q to all of KV and let the kernel skip masked blocks.
The backward ring sends dK/dV along the same path one step behind K/V, so they arrive back at their owner,
accumulated and sent in float32, or with `plan.ring_grad_dtype="compute"` in K/V's dtype (half the bytes in
bfloat16; each step's terms are still computed in float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallel import kernels
from parallel.strategies.common import axis_shards, global_index, run_sharded


def merge(out_a, lse_a, out_b, lse_b):
    """Combines two partial attentions over disjoint keys: out [..., dv] float32, lse [...]; safe when both
    lse are -inf (no visible key on either side: stays zeros / -inf)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return out_a * jnp.exp(lse_a - safe)[..., None] + out_b * jnp.exp(lse_b - safe)[..., None], lse


def ring_local(q, k, v, seg, *, axis: str, shards: int, index, causal: bool, scale: float, plan):
    """Inside a shard_map over `axis` (shards devices): q [batch, n, heads, dqk], k/v [batch, n, kv_heads, d] and
    seg [batch, n] are this device's piece; index: numpy [shards * n] global token index of every piece in order.
    Returns out [batch, n, heads, dv]."""
    dqk, n = k.shape[-1], q.shape[1]
    table = index.reshape(shards, n)  # numpy: a constant in each traced function (custom_vjp closes over no tracer)
    balanced = causal and plan.layout == "dual_chunk" and shards > 1
    blocks = dict(scale=scale, block_q=plan.block_q, block_kv=plan.block_kv)
    impl = kernels.select(plan.kernel, interpret=plan.interpret)
    half = n // 2

    def grad_dtype(kv):
        return jnp.float32 if plan.ring_grad_dtype == "float32" else kv.dtype

    to_next = [(i, (i + 1) % shards) for i in range(shards)]

    def pieces(kv, seg_all, source):
        return kv[..., :dqk], kv[..., dqk:], seg_all[source], jnp.asarray(table)[source]

    def step_forward(q, seg, kv, seg_all, rank, source, first):
        """(out float32, lse) of local queries against the KV block of `source`."""
        k_s, v_s, kv_seg, kv_index = pieces(kv, seg_all, source)
        q_index = jnp.asarray(table)[rank]
        fwd = functools.partial(impl.forward, out_dtype=jnp.float32, **blocks)
        if first or not balanced:
            return fwd(q, k_s, v_s, seg, kv_seg, q_index, kv_index, causal=causal)

        def early():  # source < rank: its first chunk precedes both of ours, its second follows both
            return fwd(q, k_s[:, :half], v_s[:, :half], seg, kv_seg[:, :half], q_index, kv_index[:half], causal=False)

        def late():  # source > rank: our first chunk sees nothing of it, our second chunk sees all of it
            out, lse = fwd(q[:, half:], k_s, v_s, seg[:, half:], kv_seg, q_index[half:], kv_index, causal=False)
            return (
                jnp.concatenate([jnp.zeros_like(out), out], axis=1),
                jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse], axis=1),
            )

        return lax.cond(source < rank, early, late)

    def step_backward(q, seg, kv, seg_all, out, lse, dout, rank, source, first):
        """(dq, dkv) float32 of local queries against the KV block of `source`."""
        k_s, v_s, kv_seg, kv_index = pieces(kv, seg_all, source)
        q_index = jnp.asarray(table)[rank]
        bwd = functools.partial(impl.backward, dlse=None, grad_dtype=jnp.float32, **blocks)
        if first or not balanced:
            dq, dk, dv = bwd(q, k_s, v_s, seg, kv_seg, q_index, kv_index, out, lse, dout, causal=causal)
            return dq, jnp.concatenate([dk, dv], axis=-1)

        def early():
            dq, dk, dv = bwd(
                q,
                k_s[:, :half],
                v_s[:, :half],
                seg,
                kv_seg[:, :half],
                q_index,
                kv_index[:half],
                out,
                lse,
                dout,
                causal=False,
            )
            dkv = jnp.concatenate([dk, dv], axis=-1)
            return dq, jnp.concatenate([dkv, jnp.zeros_like(dkv)], axis=1)

        def late():
            dq, dk, dv = bwd(
                q[:, half:],
                k_s,
                v_s,
                seg[:, half:],
                kv_seg,
                q_index[half:],
                kv_index,
                out[:, half:],
                lse[:, half:],
                dout[:, half:],
                causal=False,
            )
            return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), jnp.concatenate([dk, dv], axis=-1)

        return lax.cond(source < rank, early, late)

    def run_forward(q, kv, seg):
        rank = lax.axis_index(axis)
        seg_all = lax.all_gather(seg, axis)  # [shards, batch, n]: small, so gathered once instead of rotated
        in_flight = lax.ppermute(kv, axis, to_next) if shards > 1 else kv  # issued before step 0's compute
        # The first and the last step are peeled off the scan: the first is the causal diagonal (the local block,
        # no permute to wait for) and its result initialises the merge; the last issues no permute, since no
        # block is needed after it. The scan body is then the same for every middle step: permute, compute, merge.
        out, lse = step_forward(q, seg, kv, seg_all, rank, rank, first=True)

        def body(carry, i):
            kv, out, lse = carry
            next_kv = lax.ppermute(kv, axis, to_next)
            part = step_forward(q, seg, kv, seg_all, rank, (rank - i) % shards, first=False)
            return (next_kv, *merge(out, lse, *part)), None

        if shards > 1:
            (kv_last, out, lse), _ = lax.scan(body, (in_flight, out, lse), jnp.arange(1, shards - 1))
            out, lse = merge(out, lse, *step_forward(q, seg, kv_last, seg_all, rank, (rank + 1) % shards, first=False))
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
        dq, dkv = step_backward(q, seg, kv, seg_all, out, lse, dout, rank, rank, first=True)
        dkv = dkv.astype(grad_dtype(kv))  # accumulated and sent in this dtype; each step's terms are float32

        def body(carry, i):
            kv, dkv, dq = carry
            next_kv = lax.ppermute(kv, axis, to_next)
            dkv = lax.ppermute(dkv, axis, to_next)  # arrives with the K/V it belongs to
            dq_i, dkv_i = step_backward(q, seg, kv, seg_all, out, lse, dout, rank, (rank - i) % shards, first=False)
            return (next_kv, (dkv + dkv_i).astype(dkv.dtype), dq + dq_i), None

        if shards > 1:
            (kv_last, dkv, dq), _ = lax.scan(body, (in_flight, dkv, dq), jnp.arange(1, shards - 1))
            dkv = lax.ppermute(dkv, axis, to_next)
            dq_i, dkv_i = step_backward(
                q, seg, kv_last, seg_all, out, lse, dout, rank, (rank + 1) % shards, first=False
            )
            dq, dkv = dq + dq_i, lax.ppermute((dkv + dkv_i).astype(dkv.dtype), axis, to_next)  # home to the owner
        return dq.astype(q.dtype), dkv.astype(kv.dtype), None

    ring.defvjp(ring_fwd, ring_bwd)
    return ring(q, jnp.concatenate([k, v], axis=-1), seg)


def attention(q, k, v, *, segment_ids, causal, scale, plan, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d] -> [batch, length, heads, dv]."""
    axis, shards = plan.axis, axis_shards(mesh, plan.axis)
    index = global_index(q.shape[1], plan, shards)
    local = functools.partial(ring_local, axis=axis, shards=shards, index=index, causal=causal, scale=scale, plan=plan)
    return run_sharded(local, mesh, axis, q, k, v, segment_ids)
