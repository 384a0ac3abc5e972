"""`ulysses`: one all-to-all turns the merged [Q | K | V] from sequence-sharded to head-sharded, the local kernel
sees the whole sequence for heads/shards heads, one all-to-all turns the output back.

KV heads fewer than (or not divisible by) the shards are repeated just enough that every device gets the KV heads
its query heads use.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from parallel.kernels import sinks as attention_sinks
from parallel.strategies.common import axis_shards, kernel_options, run_sharded, whole_sequence


def check_heads(heads: int, kv_heads: int, shards: int, axis) -> None:
    """Query heads must split evenly over the Ulysses axis."""
    if heads % shards:
        raise ValueError(
            f"ulysses over mesh axis {axis!r} of size {shards} needs query heads divisible by {shards}; "
            f"got {heads} heads (choose a context size that divides {heads})"
        )


def scatter_heads(q, k, v, axis: str, shards: int):
    """Inside a shard_map: sequence pieces [batch, n, h, d] -> (q, k, v) of the whole (gathered) sequence
    [batch, n*shards, h/shards, d] for this device's heads, with ONE all-to-all carrying q, k and v together."""
    heads, kv_heads = q.shape[2], k.shape[2]
    repeat = shards // math.gcd(kv_heads, shards)
    k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    batch, n = q.shape[:2]
    parts = [x.reshape(batch, n, shards, -1) for x in (q, k, v)]
    widths = [p.shape[-1] for p in parts]
    merged = jnp.concatenate(parts, axis=-1).reshape(batch, n, -1)
    merged = lax.all_to_all(merged, axis, split_axis=2, concat_axis=1, tiled=True)  # [batch, n*shards, width]
    q_w, k_w, _ = widths
    q_h = merged[..., :q_w].reshape(batch, n * shards, heads // shards, q.shape[-1])
    k_h = merged[..., q_w : q_w + k_w].reshape(batch, n * shards, k.shape[2] // shards, k.shape[-1])
    v_h = merged[..., q_w + k_w :].reshape(batch, n * shards, k.shape[2] // shards, v.shape[-1])
    return q_h, k_h, v_h


def gather_sequence(seg, axis: str):
    """Inside a shard_map: segment ids of this device's piece [batch, n] -> the whole sequence's [batch, n*shards]."""
    return lax.all_gather(seg, axis, axis=1, tiled=True)


def gather_heads(out, axis: str):
    """Inside a shard_map: [batch, n*shards, heads/shards, dv] -> [batch, n, heads, dv] with one all-to-all."""
    return lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


def attention(q, k, v, *, segment_ids, causal, scale, window, sinks, parallelism, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d], sinks [heads] or None -> [batch, length,
    heads, dv]. Sinks apply to each device's heads before the output all-to-all (the kernel saw whole rows)."""
    axis, shards = parallelism.axis, axis_shards(mesh, parallelism.axis)
    check_heads(q.shape[2], k.shape[2], shards, axis)
    options = kernel_options(parallelism, causal=causal, scale=scale, window=window)

    def local(q, k, v, seg, sinks):
        q, k, v = scatter_heads(q, k, v, axis, shards)
        out, lse = whole_sequence(
            q, k, v, gather_sequence(seg, axis), shards=shards, options=options, parallelism=parallelism
        )
        return gather_heads(attention_sinks.apply(out, lse, attention_sinks.local_heads(sinks, axis, shards)), axis)

    return run_sharded(local, mesh, axis, q, k, v, segment_ids, sinks)
