"""Everything that knows about devices: mesh and axis rules, sequence layouts, attention strategies, scattered
tensor parallelism, expert parallelism, sharding constraints. Models and layers call `parallel.lookup` (the
embedding), `parallel.attention` (with MLA's `parallel.Latent`), `parallel.sparse_attention` and
`parallel.indexer_warmup` (with the indexer's `parallel.IndexerOutput`), `parallel.shard` (logical names),
`parallel.residual`, `parallel.gather`, `parallel.project_scatter`, `parallel.routed_experts` and, for Gated
DeltaNet, `parallel.causal_conv` and `parallel.gated_delta` only.
"""

from __future__ import annotations

import dataclasses

import jax

from parallel import compat  # noqa: F401  first of the package: refuses a JAX outside the supported range
from parallel.deepseek_sparse import IndexerOutput, indexer_warmup, sparse_attention
from parallel.experts import routed_experts
from parallel.grouped import ragged_dot
from parallel.latent import Latent
from parallel.lookup import lookup
from parallel.mesh import logical_spec
from parallel.parallelism import current_parallelism
from parallel.recurrent import causal_conv, gated_delta
from parallel.reorder import LAYOUTS
from parallel.strategies import ROTATES_LATENT, STRATEGIES
from parallel.tensor import gather, project_scatter, residual

__all__ = [
    "IndexerOutput",
    "Latent",
    "attention",
    "causal_conv",
    "gated_delta",
    "gather",
    "indexer_warmup",
    "lookup",
    "project_scatter",
    "ragged_dot",
    "residual",
    "routed_experts",
    "shard",
    "sparse_attention",
]


def attention(
    q, k, v, *, segment_ids=None, causal=True, scale=None, window=None, sinks=None, mesh=None, strategy=None, axis=None,
    layout=None, stripe=None, latent=None,
):  # fmt: skip
    """Attention over the (possibly sharded and reordered) sequence.

    q: [batch, length, heads, dqk], k: [batch, length, kv_heads, dqk], v: [batch, length, kv_heads, dv] global
    arrays with length sharded over mesh `axis` and ordered by `layout` (contiguous, dual_chunk or striped with
    `stripe`, for the size of `axis`) -> [batch, length, heads, dv] in the same order. `segment_ids`
    [batch, length] (0 = padding) keeps attention within a document; causality refers to the original order.
    `window` W (causal only): a query at original index i sees keys j with i - W < j <= i (Hugging Face's
    `sliding_window`); None = no window. `sinks` [heads] float32 (GPT-OSS): a learned logit per head joining every
    query's softmax as one more key of value zero, differentiable; None = none.
    `latent` (MLA): a `parallel.Latent` whose expansion gives k and v; the strategies that rotate K/V (ring, usp)
    rotate it instead, the others take k and v.
    Arguments left None come from the parallelism installed by `parallel.parallelism.use_parallelism` (default: strategy
    "none", axis "context", contiguous layout); mesh None = the mesh set by `jax.set_mesh`.
    """
    if sinks is not None and sinks.shape != (q.shape[2],):
        raise ValueError(
            f"attention sinks of shape {sinks.shape} must be [heads] = ({q.shape[2]},), one per query head"
        )
    if latent is not None and (latent.kv_b.shape[1], latent.kv_b.shape[2] - latent.nope) != (q.shape[2], v.shape[3]):
        raise ValueError(
            f"MLA's latent makes kv_b {latent.kv_b.shape} heads x (nope {latent.nope} + dv); it must make "
            f"{q.shape[2]} heads of values {v.shape[3]} wide, as the queries and v have"
        )
    given = dict(strategy=strategy, axis=axis, layout=layout, stripe=stripe, mesh=mesh)
    parallelism = dataclasses.replace(
        current_parallelism(), **{key: value for key, value in given.items() if value is not None}
    )
    if parallelism.strategy not in STRATEGIES:
        raise ValueError(f"attention strategy {parallelism.strategy!r} is unknown; available: {', '.join(STRATEGIES)}")
    if parallelism.layout not in LAYOUTS:
        raise ValueError(f"sequence layout {parallelism.layout!r} is unknown; available: {', '.join(LAYOUTS)}")
    mesh = parallelism.mesh if parallelism.mesh is not None else jax.sharding.get_abstract_mesh()
    if causal and isinstance(window, int) and window >= q.shape[1]:  # a window of the whole row cuts nothing
        window = None
    if (parallelism.strategy != "none" or parallelism.layout != "contiguous") and (mesh is None or mesh.empty):
        raise ValueError(
            f"attention strategy {parallelism.strategy!r} with layout {parallelism.layout!r} needs a mesh: pass "
            f"mesh= or call inside jax.set_mesh(mesh)"
        )
    rotates = {"latent": latent} if latent is not None and parallelism.strategy in ROTATES_LATENT else {}
    return STRATEGIES[parallelism.strategy](
        q,
        k,
        v,
        segment_ids=segment_ids,
        causal=causal,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        window=window,
        sinks=None if sinks is None else sinks.astype(jax.numpy.float32),
        parallelism=parallelism,
        mesh=mesh,
        **rotates,
    )


def shard(x, names):
    """Constrains activation `x` to the sharding of its logical axis names when a mesh is set; else no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_spec(names, mesh))
