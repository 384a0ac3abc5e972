"""`usp`: Ulysses over one mesh axis inside ring over another (heads x sequence). The sequence is sharded over
(ring axis, ulysses axis); a Ulysses all-to-all assembles each ring rank's piece, which the ring then treats
as its local block, load-balanced when the layout is dual_chunk over the ring size."""

from __future__ import annotations

from jax import lax

from parallel.kernels import sinks as attention_sinks
from parallel.strategies.common import axis_shards, global_index, kernel_options, run_sharded
from parallel.strategies.ring import ring_local
from parallel.strategies.ulysses import check_heads, gather_heads, gather_sequence, scatter_heads


def attention(q, k, v, *, segment_ids, causal, scale, window, sinks, parallelism, mesh, latent=None):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d], sinks [heads] or None -> [batch, length,
    heads, dv]. parallelism.axis = (ring axis, ulysses axis). latent: a `parallel.latent.Latent` making k and v: its
    rows are gathered over the Ulysses axis (every head needs them) and rotate around the ring in K/V's place, each
    device expanding them for its heads."""
    if isinstance(parallelism.axis, str) or len(parallelism.axis) != 2:
        raise ValueError(f"usp needs axis=(ring axis, ulysses axis), got {parallelism.axis!r}")
    ring_axis, ulysses_axis = parallelism.axis
    ring_shards, ulysses_shards = axis_shards(mesh, ring_axis), axis_shards(mesh, ulysses_axis)
    check_heads(q.shape[2], k.shape[2], ulysses_shards, ulysses_axis)
    index = global_index(q.shape[1], parallelism, ring_shards)
    options = kernel_options(parallelism, causal=causal, scale=scale, window=window)

    def local(q, k, v, seg, sinks, latent=None):
        if latent is None:
            q, k, v = scatter_heads(q, k, v, ulysses_axis, ulysses_shards)
        else:  # only the queries change hands by heads; k and v go unused
            rows, kv_b, nope = latent
            q = lax.all_to_all(q, ulysses_axis, split_axis=2, concat_axis=1, tiled=True)  # as scatter_heads splits
            latent = gather_sequence(rows, ulysses_axis), kv_b, nope
        seg = gather_sequence(seg, ulysses_axis)
        sinks = attention_sinks.local_heads(sinks, ulysses_axis, ulysses_shards)
        ring = dict(axis=ring_axis, shards=ring_shards, index=index, options=options, parallelism=parallelism)
        return gather_heads(ring_local(q, k, v, seg, sinks, latent, **ring), ulysses_axis)

    return run_sharded(local, mesh, parallelism.axis, q, k, v, segment_ids, sinks, latent, latent_heads=ulysses_axis)
