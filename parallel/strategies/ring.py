"""`ring`: K and V travel around the context axis, one `ppermute` of each per step, while each device attends its
local queries to the piece it holds; partial results merge by log-sum-exp in fp32.

The step against our own piece is the causal diagonal (indices: positions, the same order, so the kernel knows it
at trace time). Every later step is one of two static calls chosen at run time by whether the arriving piece
comes from a lower or a higher rank (parallel/strategies/ring_steps.py): in the dual_chunk layout all Q x its
first chunk, or our second chunk x all of it, the same FLOPs on every rank, each one all-visible kernel call whose
out / lse merge into their rows of the running result in place. A sliding window compares global indices (the
rank's, traced), so its steps are one call over the whole piece with those indices, the kernel skipping what
the window leaves out. The backward ring sends dK/dV along the same path one step behind K/V, so they arrive back
at their owner; each step's kernel adds its terms into the running dq / dK / dV (in place in the blockwise
kernel). dK/dV sum and travel in float32, or with `plan.ring_grad_dtype="compute"` in K/V's dtype (half the bytes in
bfloat16; each step's terms are still computed in float32).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel.kernels import Options, Tokens
from parallel.kernels import sinks as attention_sinks
from parallel.lse_merge import merge
from parallel.strategies import halo
from parallel.strategies.common import axis_shards, global_index, kernel_options, plan_kernel, run_sharded
from parallel.strategies.ring_steps import StepShape, step_shapes


class Residuals(NamedTuple):
    """What the ring's backward keeps of its forward, on each device."""

    q: jax.Array  # [batch, n, heads, dqk] local queries
    kv: tuple[jax.Array, jax.Array]  # (k, v) [batch, n, kv_heads, d] of the local piece
    seg: jax.Array  # [batch, n] int32 segment ids of the local piece
    seg_all: jax.Array  # [shards, batch, n] int32 every rank's segment ids
    out: jax.Array  # [batch, n, heads, dv] float32 merged output
    lse: jax.Array  # [batch, n, heads] float32 merged log-sum-exp


def ring_local(q, k, v, seg, sinks=None, *, axis: str, shards: int, index, options: Options, plan):
    """Inside a shard_map over `axis` (shards devices): q [batch, n, heads, dqk], k/v [batch, n, kv_heads, d] and
    seg [batch, n] are this device's piece, sinks [heads] or None; index: numpy [shards * n] global token index of
    every piece in order. Returns out [batch, n, heads, dv], the sinks applied once to the merged pieces (the
    merged lse's cotangent then joins each step's backward). A window whose halo is smaller than the ring's pieces
    runs the halo exchange instead (usp's ring too)."""
    found = halo.shifts(index, shards, options.window)
    if found is not None:
        exchange = dict(axis=axis, shards=shards, index=index, found=found, options=options, plan=plan)
        return halo.halo_local(q, k, v, seg, sinks, **exchange)
    n = q.shape[1]
    table = index.reshape(shards, n)  # numpy: a constant in each traced function (custom_vjp closes over no tracer)
    impl = plan_kernel(plan)
    own = np.arange(n, dtype=np.int32)
    # Without a window a step's shape is fixed by whether its piece comes from a lower or a higher rank; a window
    # compares global indices, which are the rank's (traced), so its steps take them as they are.
    shapes = (
        None
        if options.window is not None
        else step_shapes(plan.layout if shards > 1 else "contiguous", n, plan.stripe, options.causal)
    )

    def grad_dtype(x):
        return jnp.float32 if plan.ring_grad_dtype == "float32" else x.dtype

    to_next = [(i, (i + 1) % shards) for i in range(shards)]

    def own_sides(seg, rank) -> tuple[Tokens, Tokens]:
        """The step against our own piece: indices are positions (static: the kernel knows the causal diagonal at
        trace time; a piece is in increasing global order), or with a window our global indices."""
        if options.window is None:
            return Tokens(seg, own), Tokens(seg, own)
        mine = Tokens(seg, jnp.asarray(table)[rank])
        return mine, mine

    def windowed_sides(seg, seg_source, rank, source) -> tuple[Tokens, Tokens]:
        """A windowed step's sides: both pieces' traced global indices."""
        return Tokens(seg, jnp.asarray(table)[rank]), Tokens(seg_source, jnp.asarray(table)[source])

    def visible_step(shape: StepShape | None, run, unchanged):
        """A branch running `run(shape)` on the step's operands, or returning `unchanged` of them when nothing is
        visible."""
        return unchanged if shape is None else functools.partial(run, shape)

    def forward_half(shape: StepShape, q, k, v, seg, seg_source, out, lse):
        """(out, lse) float32 with the step of `shape` merged into its query rows."""
        rows, keys = shape.queries, shape.keys
        sides = Tokens(seg[:, rows], shape.q_index), Tokens(seg_source[:, keys], shape.kv_index)
        step_options = dataclasses.replace(options, causal=shape.causal)
        part = impl.forward(q[:, rows], k[:, keys], v[:, keys], *sides, options=step_options, out_dtype=jnp.float32)
        merged_out, merged_lse = merge(out[:, rows], lse[:, rows], *part)
        return out.at[:, rows].set(merged_out), lse.at[:, rows].set(merged_lse)

    def step_forward(q, seg, kv, seg_all, rank, source, out, lse):
        """(out, lse) float32 with the local queries' step against the KV block of `source` merged in."""
        seg_source = seg_all[source]
        if shapes is None:
            part = impl.forward(q, *kv, *windowed_sides(seg, seg_source, rank, source), options=options,
                                out_dtype=jnp.float32)  # fmt: skip
            return merge(out, lse, *part)
        unchanged = lambda q, k, v, seg, seg_source, out, lse: (out, lse)
        lower, higher = (visible_step(shape, forward_half, unchanged) for shape in shapes)
        if not options.causal:  # every piece whole: no choice
            return lower(q, *kv, seg, seg_source, out, lse)
        return lax.cond(source < rank, lower, higher, q, *kv, seg, seg_source, out, lse)

    def backward_half(shape: StepShape, res: Residuals, k, v, seg_source, dout, dlse, dq, dk, dv):
        """(dq, dk, dv) with the terms of the step of `shape` added into their rows."""
        rows, keys = shape.queries, shape.keys
        sides = Tokens(res.seg[:, rows], shape.q_index), Tokens(seg_source[:, keys], shape.kv_index)
        step_options = dataclasses.replace(options, causal=shape.causal)
        part = impl.backward(
            res.q[:, rows], k[:, keys], v[:, keys], *sides, res.out[:, rows], res.lse[:, rows], dout[:, rows],
            None if dlse is None else dlse[:, rows], options=step_options,
            accumulate=(dq[:, rows], dk[:, keys], dv[:, keys]),
        )  # fmt: skip
        return dq.at[:, rows].set(part[0]), dk.at[:, keys].set(part[1]), dv.at[:, keys].set(part[2])

    def step_backward(res: Residuals, kv, dout, dlse, rank, source, grads):
        """grads = (dq float32, dk, dv) with the terms of local queries against the KV block `kv` of `source` added."""
        seg_source = res.seg_all[source]
        if shapes is None:
            sides = windowed_sides(res.seg, seg_source, rank, source)
            return impl.backward(res.q, *kv, *sides, res.out, res.lse, dout, dlse, options=options, accumulate=grads)
        unchanged = lambda res, k, v, seg_source, dout, dlse, dq, dk, dv: (dq, dk, dv)
        lower, higher = (visible_step(shape, backward_half, unchanged) for shape in shapes)
        if not options.causal:  # every piece whole: no choice
            return lower(res, *kv, seg_source, dout, dlse, *grads)
        return lax.cond(source < rank, lower, higher, res, *kv, seg_source, dout, dlse, *grads)

    def run_forward(q, kv, seg):
        """((out in q's dtype, lse float32), Residuals)."""
        rank = lax.axis_index(axis)
        seg_all = lax.all_gather(seg, axis)  # [shards, batch, n]: small, so gathered once instead of rotated
        in_flight = lax.ppermute(kv, axis, to_next) if shards > 1 else kv  # issued before step 0's compute
        # The first and the last step are peeled off the scan: the first is the causal diagonal (the local block,
        # no permute to wait for) and its result initialises the merge; the last issues no permute, since no
        # block is needed after it. The scan body is then the same for every middle step: permute, compute, merge.
        out, lse = impl.forward(q, *kv, *own_sides(seg, rank), options=options, out_dtype=jnp.float32)

        def body(carry, i):
            kv, out, lse = carry
            next_kv = lax.ppermute(kv, axis, to_next)
            return (next_kv, *step_forward(q, seg, kv, seg_all, rank, (rank - i) % shards, out, lse)), None

        if shards > 1:
            (kv_last, out, lse), _ = lax.scan(body, (in_flight, out, lse), jnp.arange(1, shards - 1))
            out, lse = step_forward(q, seg, kv_last, seg_all, rank, (rank + 1) % shards, out, lse)
        return (out.astype(q.dtype), lse), Residuals(q, kv, seg, seg_all, out, lse)

    @jax.custom_vjp
    def ring(q, kv, seg):
        return run_forward(q, kv, seg)[0]

    def ring_bwd(res: Residuals, cotangents):
        dout, dlse = cotangents
        dlse = None if sinks is None else dlse  # only the sinks use the lse
        rank = lax.axis_index(axis)
        in_flight = lax.ppermute(res.kv, axis, to_next) if shards > 1 else res.kv
        # dq sums in float32; dk and dv sum and travel in grad_dtype; each step's terms are float32
        zeros = (
            jnp.zeros(res.q.shape, jnp.float32),
            *(jnp.zeros(x.shape, grad_dtype(x)) for x in res.kv),
        )
        q_tokens, kv_tokens = own_sides(res.seg, rank)
        dq, dk, dv = impl.backward(
            res.q, *res.kv, q_tokens, kv_tokens, res.out, res.lse, dout, dlse, options=options, accumulate=zeros
        )

        def body(carry, i):
            kv, (dq, dk, dv) = carry
            next_kv = lax.ppermute(kv, axis, to_next)
            dk, dv = lax.ppermute((dk, dv), axis, to_next)  # arrive with the K/V they belong to
            return (next_kv, step_backward(res, kv, dout, dlse, rank, (rank - i) % shards, (dq, dk, dv))), None

        if shards > 1:
            (kv_last, (dq, dk, dv)), _ = lax.scan(body, (in_flight, (dq, dk, dv)), jnp.arange(1, shards - 1))
            dk, dv = lax.ppermute((dk, dv), axis, to_next)
            dq, dk, dv = step_backward(res, kv_last, dout, dlse, rank, (rank + 1) % shards, (dq, dk, dv))
            dk, dv = lax.ppermute((dk, dv), axis, to_next)  # home to the owner
        return dq.astype(res.q.dtype), (dk.astype(res.kv[0].dtype), dv.astype(res.kv[1].dtype)), None

    ring.defvjp(run_forward, ring_bwd)
    return attention_sinks.apply(*ring(q, (k, v), seg), sinks)


def attention(q, k, v, *, segment_ids, causal, scale, window, sinks, plan, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d], sinks [heads] or None -> [batch, length,
    heads, dv]. With a window each device receives only the keys its windows reach (parallel/strategies/halo.py)
    when that is less than the ring's cp - 1 pieces; else every step runs, its kernel skipping the block pairs
    outside the window."""
    axis, shards = plan.axis, axis_shards(mesh, plan.axis)
    index = global_index(q.shape[1], plan, shards)
    options = kernel_options(plan, causal=causal, scale=scale, window=window)
    local = functools.partial(ring_local, axis=axis, shards=shards, index=index, options=options, plan=plan)
    return run_sharded(local, mesh, axis, q, k, v, segment_ids, sinks)
