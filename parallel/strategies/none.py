"""`none`: the kernel on the whole sequence (no context parallelism), on each device's batch rows and heads
(shard_map, so the partitioner never gathers them)."""

from __future__ import annotations

from parallel.kernels import sinks as attention_sinks
from parallel.strategies.common import axis_shards, kernel_options, run_sharded, whole_sequence


def attention(q, k, v, *, segment_ids, causal, scale, window, sinks, parallelism, mesh):
    """q: [batch, length, heads, dqk], k/v: [batch, length, kv_heads, d], sinks [heads] or None -> [batch, length,
    heads, dv]."""
    shards = 1 if parallelism.layout == "contiguous" else axis_shards(mesh, parallelism.axis)
    options = kernel_options(parallelism, causal=causal, scale=scale, window=window)

    def local(q, k, v, segment_ids, sinks):
        out, lse = whole_sequence(q, k, v, segment_ids, shards=shards, options=options, parallelism=parallelism)
        return attention_sinks.apply(out, lse, sinks)

    if mesh is None or mesh.empty:
        return local(q, k, v, segment_ids, sinks)
    return run_sharded(local, mesh, (), q, k, v, segment_ids, sinks)  # whole sequence per device, batch / heads sharded
