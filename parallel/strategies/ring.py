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
kernel). dK/dV sum and travel in float32, or with `parallelism.ring_grad_dtype="compute"` in K/V's dtype (half the bytes
in bfloat16; each step's terms are still computed in float32). Given MLA's latent (parallel/latent.py), its rows
travel in K/V's place and each step expands the rows it attends to; the rows' gradient travels back as dK/dV do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel import anchored
from parallel.kernels import Options, Tokens, saved
from parallel.kernels import sinks as attention_sinks
from parallel.latent import expand as expand_latent
from parallel.lse_merge import merge
from parallel.strategies import halo
from parallel.strategies.common import (
    RowTerms,
    axis_shards,
    chosen_kernel,
    global_index,
    kernel_options,
    run_sharded,
)
from parallel.strategies.ring_steps import StepShape, step_shapes


class Residuals(NamedTuple):
    """What the ring's backward keeps of its forward, on each device."""

    q: jax.Array  # [batch, n, heads, dqk] local queries
    travel: Any  # what rotates: (k, v) [batch, n, kv_heads, d] of the local piece, or MLA's latent rows
    fixed: Any  # what stays and makes K/V of `travel`: () or MLA's kv_b
    seg: jax.Array  # [batch, n] int32 segment ids of the local piece
    seg_all: jax.Array  # [shards, batch, n] int32 every rank's segment ids
    out: jax.Array  # [batch, n, heads, dv] merged output in q's dtype (as FlashAttention keeps it: half the bytes)
    lse: jax.Array  # [batch, n, heads] float32 merged log-sum-exp


def ring_local(q, k, v, seg, sinks=None, latent=None, *, axis: str, shards: int, index, options: Options, parallelism):
    """Inside a shard_map over `axis` (shards devices): q [batch, n, heads, dqk], k/v [batch, n, kv_heads, d] and
    seg [batch, n] are this device's piece, sinks [heads] or None; index: numpy [shards * n] global token index of
    every piece in order. Returns out [batch, n, heads, dv], the sinks applied once to the merged pieces (the
    merged lse's cotangent then joins each step's backward). A window whose halo is smaller than the ring's pieces
    runs the halo exchange instead (usp's ring too). latent: (rows [batch, n, kv_lora + rope], kv_b [kv_lora, heads,
    nope + dv], nope) or None: MLA's latent rows rotate instead of K/V (parallel/latent.py), each step expanding
    the rows it attends to, and their gradient travels back instead of dK/dV (k and v then go unused)."""
    found = halo.shifts(index, shards, options.window)
    if found is not None:
        if latent is not None:
            k, v = expand_latent(latent[1], latent[0], latent[2])
        exchange = dict(axis=axis, shards=shards, index=index, found=found, options=options, parallelism=parallelism)
        return halo.halo_local(q, k, v, seg, sinks, **exchange)
    n = q.shape[1]
    table = index.reshape(shards, n)  # numpy: a constant in each traced function (custom_vjp closes over no tracer)
    impl = chosen_kernel(parallelism)
    own = np.arange(n, dtype=np.int32)
    # Without a window a step's shape is fixed by whether its piece comes from a lower or a higher rank; a window
    # compares global indices, which are the rank's (traced), so its steps take them as they are.
    shapes = (
        None
        if options.window is not None
        else step_shapes(parallelism.layout if shards > 1 else "contiguous", n, parallelism.stripe, options.causal)
    )
    if latent is None:
        travel, fixed = (k, v), ()
        expand = lambda fixed, kv: kv
    else:
        travel, fixed = latent[0], latent[1]
        expand = functools.partial(lambda nope, kv_b, rows: expand_latent(kv_b, rows, nope), latent[2])

    def grad_dtype(x):
        return jnp.float32 if parallelism.ring_grad_dtype == "float32" else x.dtype

    to_next = [(i, (i + 1) % shards) for i in range(shards)]

    def middle_steps(body, carry):
        """`carry` through the steps 1 .. shards - 2 (none with 2 shards: no scan of length zero, whose empty stacked
        residuals would enter the backward's shard_map as zero-size operands)."""
        return lax.scan(body, carry, jnp.arange(1, shards - 1))[0] if shards > 2 else carry

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

    def rows_of(tree, rows):
        return jax.tree.map(lambda x: x[:, rows], tree)

    def put_rows(total, part, rows: slice):
        """`total` [batch, n, ...] with `part` in its rows `rows` (static): an in-place update, never a scatter, and
        `part` itself where it is every row (a full-row update would scatter by a zero-length index constant, which
        crashes XLA 0.11.2's GPU compiler inside a shard_map)."""
        if rows.indices(total.shape[1]) == (0, total.shape[1], 1):
            return part
        return lax.dynamic_update_slice_in_dim(total, part, rows.start, axis=1)

    def forward_call(q, fixed, travel, sides, step_options):
        """(out, lse) float32 of queries q against the K/V that `travel` holds or makes."""
        return impl.forward(q, *expand(fixed, travel), *sides, options=step_options, out_dtype=jnp.float32)

    def backward_call(q, fixed, travel, sides, lse, dout, terms: RowTerms, step_options, dq, dtravel, dfixed):
        """(dq, dtravel, dfixed) with the terms of one call added: dK/dV straight into the running sums, or through
        the latent's expansion (its rows' and kv_b's gradients)."""
        if latent is None:
            dq, dk, dv = terms.backward(impl, q, *travel, *sides, lse, dout, options=step_options,
                                        accumulate=(dq, *dtravel))  # fmt: skip
            return dq, (dk, dv), dfixed
        (k, v), pull = jax.vjp(expand, fixed, travel)
        fresh = tuple(jnp.zeros(x.shape, jnp.float32) for x in (k, v))
        dq, dk, dv = terms.backward(impl, q, k, v, *sides, lse, dout, options=step_options, accumulate=(dq, *fresh))
        dfixed_step, dtravel_step = pull((dk.astype(k.dtype), dv.astype(v.dtype)))
        return dq, dtravel + dtravel_step.astype(dtravel.dtype), dfixed + dfixed_step.astype(dfixed.dtype)

    def visible_step(shape: StepShape | None, run, unchanged):
        """A branch running `run(shape)` on the step's operands, or returning `unchanged` of them when nothing is
        visible."""
        return unchanged if shape is None else functools.partial(run, shape)

    def forward_half(shape: StepShape, q, fixed, travel, seg, seg_source, out, lse):
        """(out, lse) float32 with the step of `shape` merged into its query rows."""
        rows, keys = shape.queries, shape.keys
        sides = Tokens(seg[:, rows], shape.q_index), Tokens(seg_source[:, keys], shape.kv_index)
        step_options = dataclasses.replace(options, causal=shape.causal)
        part = forward_call(q[:, rows], fixed, rows_of(travel, keys), sides, step_options)
        merged_out, merged_lse = merge(out[:, rows], lse[:, rows], *part)
        return put_rows(out, merged_out, rows), put_rows(lse, merged_lse, rows)

    def step_forward(q, seg, fixed, travel, seg_all, rank, source, out, lse):
        """(out, lse) float32 with the local queries' step against the piece of `source` merged in."""
        seg_source = seg_all[source]
        if shapes is None:
            sides = windowed_sides(seg, seg_source, rank, source)
            return merge(out, lse, *forward_call(q, fixed, travel, sides, options))
        unchanged = lambda q, fixed, travel, seg, seg_source, out, lse: (out, lse)
        lower, higher = (visible_step(shape, forward_half, unchanged) for shape in shapes)
        if not options.causal:  # every piece whole: no choice
            return lower(q, fixed, travel, seg, seg_source, out, lse)
        return lax.cond(source < rank, lower, higher, q, fixed, travel, seg, seg_source, out, lse)

    def backward_half(shape: StepShape, res: Residuals, travel, seg_source, dout, terms: RowTerms, grads):
        """grads (dq, dtravel, dfixed) with the terms of the step of `shape` added into their rows."""
        rows, keys = shape.queries, shape.keys
        sides = Tokens(res.seg[:, rows], shape.q_index), Tokens(seg_source[:, keys], shape.kv_index)
        step_options = dataclasses.replace(options, causal=shape.causal)
        dq, dtravel, dfixed = grads
        part = backward_call(
            res.q[:, rows], res.fixed, rows_of(travel, keys), sides, res.lse[:, rows], dout[:, rows],
            rows_of(terms, rows), step_options, dq[:, rows], rows_of(dtravel, keys), dfixed,
        )  # fmt: skip
        put = lambda total, part: put_rows(total, part, keys)
        return put_rows(dq, part[0], rows), jax.tree.map(put, dtravel, part[1]), part[2]

    def step_backward(res: Residuals, travel, dout, terms: RowTerms, rank, source, grads):
        """grads (dq float32, dtravel, dfixed) with the terms of local queries against the piece `travel` of `source`
        added."""
        seg_source = res.seg_all[source]
        if shapes is None:
            sides = windowed_sides(res.seg, seg_source, rank, source)
            return backward_call(res.q, res.fixed, travel, sides, res.lse, dout, terms, options, *grads)
        unchanged = lambda res, travel, seg_source, dout, terms, grads: grads
        lower, higher = (visible_step(shape, backward_half, unchanged) for shape in shapes)
        if not options.causal:  # every piece whole: no choice
            return lower(res, travel, seg_source, dout, terms, grads)
        return lax.cond(source < rank, lower, higher, res, travel, seg_source, dout, terms, grads)

    def run_forward(q, fixed, travel, seg):
        """((out in q's dtype, lse float32), Residuals)."""
        rank = lax.axis_index(axis)
        seg_all = lax.all_gather(seg, axis)  # [shards, batch, n]: small, so gathered once instead of rotated
        in_flight = lax.ppermute(travel, axis, to_next) if shards > 1 else travel  # issued before step 0's compute
        # The first and the last step are peeled off the scan: the first is the causal diagonal (the local block,
        # no permute to wait for) and its result initialises the merge; the last issues no permute, since no
        # block is needed after it. The scan body is then the same for every middle step: permute, compute, merge.
        out, lse = forward_call(q, fixed, travel, own_sides(seg, rank), options)

        def body(carry, i):
            travel, out, lse = carry
            arriving = lax.ppermute(travel, axis, to_next)
            return (arriving, *step_forward(q, seg, fixed, travel, seg_all, rank, (rank - i) % shards, out, lse)), None

        if shards > 1:
            last, out, lse = middle_steps(body, (in_flight, out, lse))
            out, lse = step_forward(q, seg, fixed, last, seg_all, rank, (rank + 1) % shards, out, lse)
        out, lse = saved.named(out.astype(q.dtype), lse)
        return (out, lse), Residuals(q, travel, fixed, seg, seg_all, out, lse)

    @jax.custom_vjp
    def ring(q, fixed, travel, seg):
        return run_forward(q, fixed, travel, seg)[0]

    def ring_bwd(res: Residuals, cotangents):
        dout, dlse = cotangents
        dlse = None if sinks is None else dlse  # only the sinks use the lse
        rank = lax.axis_index(axis)
        terms = RowTerms.of(impl, res.out, dout, dlse)
        # The first send and the running sums wait for dout: made from what the forward already holds, XLA would
        # schedule them before the forward, live through it.
        res = res._replace(travel=anchored.after(dout, res.travel), out=None)
        in_flight = lax.ppermute(res.travel, axis, to_next) if shards > 1 else res.travel
        # dq and kv_b's gradient sum in float32; what travels sums and travels in grad_dtype; each step's terms are
        # float32
        zeros = lambda dtype: lambda x: anchored.full(dout, x.shape, 0, dtype(x))
        grads = (
            anchored.full(dout, res.q.shape, 0, jnp.float32),
            jax.tree.map(zeros(grad_dtype), res.travel),
            jax.tree.map(zeros(lambda x: jnp.float32), res.fixed),
        )
        sides = own_sides(res.seg, rank)
        grads = backward_call(res.q, res.fixed, res.travel, sides, res.lse, dout, terms, options, *grads)

        def body(carry, i):
            travel, (dq, dtravel, dfixed) = carry
            arriving = lax.ppermute(travel, axis, to_next)
            dtravel = lax.ppermute(dtravel, axis, to_next)  # arrives with the piece it belongs to
            source = (rank - i) % shards
            return (arriving, step_backward(res, travel, dout, terms, rank, source, (dq, dtravel, dfixed))), None

        if shards > 1:
            last, (dq, dtravel, dfixed) = middle_steps(body, (in_flight, grads))
            dtravel = lax.ppermute(dtravel, axis, to_next)
            grads = step_backward(res, last, dout, terms, rank, (rank + 1) % shards, (dq, dtravel, dfixed))
            dq, dtravel, dfixed = grads
            grads = dq, lax.ppermute(dtravel, axis, to_next), dfixed  # home to the owner
        dq, dtravel, dfixed = grads
        cast = lambda d, x: d.astype(x.dtype)
        return cast(dq, res.q), jax.tree.map(cast, dfixed, res.fixed), jax.tree.map(cast, dtravel, res.travel), None

    ring.defvjp(run_forward, ring_bwd)
    return attention_sinks.apply(*ring(q, fixed, travel, seg), sinks)


def attention(q, k, v, *, segment_ids, causal, scale, window, sinks, parallelism, mesh, latent=None):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d], sinks [heads] or None -> [batch, length,
    heads, dv]. With a window each device receives only the keys its windows reach (parallel/strategies/halo.py)
    when that is less than the ring's cp - 1 pieces; else every step runs, its kernel skipping the block pairs
    outside the window. latent: a `parallel.latent.Latent` making k and v, which then rotates in their place."""
    axis, shards = parallelism.axis, axis_shards(mesh, parallelism.axis)
    index = global_index(q.shape[1], parallelism, shards)
    options = kernel_options(parallelism, causal=causal, scale=scale, window=window)
    local = functools.partial(
        ring_local, axis=axis, shards=shards, index=index, options=options, parallelism=parallelism
    )
    return run_sharded(local, mesh, axis, q, k, v, segment_ids, sinks, latent)
