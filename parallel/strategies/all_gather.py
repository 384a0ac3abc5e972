"""`all_gather`: each device gathers K/V over the context axis and attends its local queries to all of them.

The backward pass of each gather is a reduce-scatter of dK / dV. K and V are gathered separately: stacking them
into one collective would copy the whole gathered sequence twice more (stack, then slice for the kernel).

Under a packed kernel (cuDNN's or FlashAttention-3's, whose masks know segments and each run's own causality, not
global indices) the gathered K/V are put in original order and each query chunk of the local piece (one, or two in
dual_chunk) makes two calls merged by log-sum-exp: its own keys (the causal diagonal) and every key before the chunk,
later keys masked as padding (all-visible). Other layouts (striped: many chunks per piece) and windowed calls run the
kernel's general kernel (Pallas on GPU), which it would fall back to for every call anyway. Under splash the
gathered K/V are put in original order too: its mask of the local queries' (traced) indices against keys 0..length-1
is then computed in the kernel, and blocks no query sees are skipped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel import kernels
from parallel.kernels import Options, Tokens
from parallel.kernels import sinks as attention_sinks
from parallel.lse_merge import merge
from parallel.reorder import from_balanced
from parallel.strategies import halo
from parallel.strategies.common import (
    axis_shards,
    chosen_kernel,
    global_index,
    kernel,
    kernel_options,
    local_piece,
    run_sharded,
    wants_original_order,
)


def attention(q, k, v, *, segment_ids, causal, scale, window, sinks, parallelism, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d], sinks [heads] or None -> [batch, length,
    heads, dv]. With a window each device receives only the keys its windows reach (parallel/strategies/halo.py)
    when that is less than the whole sequence."""
    axis, shards = parallelism.axis, axis_shards(mesh, parallelism.axis)
    index = global_index(q.shape[1], parallelism, shards)
    in_order, chunked = (
        wants_original_order(parallelism),
        parallelism.layout in ("contiguous", "dual_chunk") or shards == 1,
    )
    if in_order and (not chunked or window is not None):  # striped, or a window: no call a packed kernel serves
        parallelism = dataclasses.replace(
            parallelism, kernel=kernels.general_kernel(chosen_kernel(parallelism).name, parallelism.platform)
        )
    options = kernel_options(parallelism, causal=causal, scale=scale, window=window)
    found = halo.shifts(index, shards, window)
    if found is not None:
        exchange = dict(axis=axis, shards=shards, index=index, found=found, options=options, parallelism=parallelism)
        return run_sharded(functools.partial(halo.halo_local, **exchange), mesh, axis, q, k, v, segment_ids, sinks)
    by_chunks = in_order and chunked and window is None
    fixed_masks = chosen_kernel(parallelism).name in kernels.FIXED_MASKS
    keys_in_order = fixed_masks and shards > 1 and parallelism.layout != "contiguous"

    def local(q, k, v, seg, sinks):
        k_all, v_all, seg_all = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v, seg))
        q_tokens = Tokens(seg, local_piece(index, shards, lax.axis_index(axis)))
        if by_chunks:
            layout = dict(layout=parallelism.layout if shards > 1 else "contiguous", axis=1)
            k_all, v_all, seg_all = (from_balanced(x, shards, **layout) for x in (k_all, v_all, seg_all))
            chunks = 2 if layout["layout"] == "dual_chunk" else 1
            out, lse = chunk_calls(
                q, k, v, q_tokens, k_all, v_all, seg_all, chunks=chunks, options=options, parallelism=parallelism
            )
        else:
            kv_tokens = Tokens(seg_all, index)
            if keys_in_order:  # splash: traced query indices against keys 0..length-1 (its mask in the kernel)
                layout = dict(layout=parallelism.layout, stripe=parallelism.stripe, axis=1)
                k_all, v_all, seg_all = (from_balanced(x, shards, **layout) for x in (k_all, v_all, seg_all))
                kv_tokens = Tokens(seg_all, np.arange(k_all.shape[1], dtype=np.int32))
            out, lse = kernel(q, k_all, v_all, q_tokens, kv_tokens, options=options, parallelism=parallelism)
        return attention_sinks.apply(out, lse, sinks)

    return run_sharded(local, mesh, axis, q, k, v, segment_ids, sinks)


def chunk_calls(q, k, v, q_tokens: Tokens, k_all, v_all, seg_all, *, chunks: int, options: Options, parallelism):
    """The local piece's attention as calls a packed kernel serves. q [batch, n, heads, dqk], k/v [batch, n,
    kv_heads, d], q_tokens (segment ids [batch, n], traced global index [n]): this device's piece, `chunks` runs of
    consecutive tokens; k_all/v_all [batch, length, ...], seg_all [batch, length]: the whole sequence in original order.
    -> (out [batch, n, heads, dv], lse [batch, n, heads])."""
    everything = np.arange(k_all.shape[1], dtype=np.int32)
    if not options.causal:
        piece = np.arange(q.shape[1], dtype=np.int32)  # increasing, as the piece's index is: only the order matters
        sides = (q_tokens._replace(index=piece), Tokens(seg_all, everything))
        return kernel(q, k_all, v_all, *sides, options=options, parallelism=parallelism)
    size = q.shape[1] // chunks
    own = np.arange(size, dtype=np.int32)
    prior_options = dataclasses.replace(options, causal=False)
    outs, lses = [], []
    for c in range(chunks):
        part = slice(c * size, (c + 1) * size)
        q_c, chunk = q[:, part], Tokens(q_tokens.segment_ids[:, part], own)
        out, lse = kernel(q_c, k[:, part], v[:, part], chunk, chunk, options=options, parallelism=parallelism)
        before = jnp.where(everything < q_tokens.index[c * size], seg_all, 0)  # keys after the chunk's first as padding
        prior = kernel(
            q_c, k_all, v_all, chunk, Tokens(before, everything), options=prior_options, parallelism=parallelism
        )
        out, lse = merge(out.astype(jnp.float32), lse, prior[0].astype(jnp.float32), prior[1])
        outs.append(out.astype(q.dtype))
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)
