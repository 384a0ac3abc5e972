"""DeepSeek sparse attention (DSA, DeepSeek-V3.2 and GLM-5): the indexer's scores choose each query's `count` best
visible keys (parallel.kernels.top_k) and attention reads only those (parallel.kernels.selected_attention). MLA's latent
is the one key and value every head shares there (the absorbed form DeepSeek runs), so a query block gathers
kv_lora + rope numbers per selected key, not heads x (nope + rope + dv). Beside the output comes the indexer's loss
(parallel.kernels.index_loss): over the selection in `sparse_attention`, over every visible key in `indexer_warmup`
(the dense warm-up, whose output is dense attention's). Over context devices the row's indexer keys and latents are
gathered (see sparse_attention). (A row no longer than `count` selects every visible key: that is dense attention,
which models run with `parallel.attention`.)"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from parallel import tensor
from parallel.kernels import Options, Tokens, selected_attention
from parallel.kernels.index_loss import dense_kl, selection_kl
from parallel.kernels.top_k import top_k
from parallel.latent import Latent
from parallel.mesh import logical_spec
from parallel.parallelism import current_parallelism
from parallel.strategies.common import (
    axis_shards,
    global_index,
    layout_shards,
    local_piece,
    mention_unit_axes,
    specs,
)


class IndexerOutput(NamedTuple):
    """The indexer's output for each token: queries [batch, length, heads, d], keys [batch, length, d] and weights
    [batch, length, heads] float32 (the scales folded in); score[s, t] = sum_h weights[s, h] relu(q[s, h] . k[t])."""

    queries: jax.Array
    keys: jax.Array
    weights: jax.Array


def sparse_attention(q, latent: Latent, *, indexer_out: IndexerOutput, count: int, segment_ids=None, scale=None):
    """Causal MLA of each query over the `count` visible keys of highest index score. q [batch, length, heads,
    nope + rope], MLA's `latent` (parallel.Latent), `segment_ids` [batch, length] (0 = padding) -> (out [batch,
    length, heads, dv], the indexer's loss per query [batch, length] float32: the KL divergence from the attention's
    distribution over the selected keys (heads summed) to the softmax of their index scores, differentiable in
    `indexer_out` only); arrays in the parallelism's sequence layout (parallel.parallelism), length sharded over its
    axis.

    Split over context devices (any strategy: the selection may pick keys anywhere before the query), each device
    gathers the row's indexer keys [length, d] and latents [length, kv_lora + rope] and scores its own queries
    against every key: the latents move as a ring's rotation moves them, the indexer keys d / (kv_lora + rope) more
    (128 / 576 in DeepSeek-V3.2); the backward reduce-scatters the latents' gradient."""
    attend = functools.partial(_attend, count=count, lora=latent.kv_b.shape[0], heads=q.shape[2])
    out, kl = _run(attend, q, latent, indexer_out, segment_ids, scale, attends=True)
    return jnp.einsum("bthr,rhd->bthd", out, latent.kv_b[..., latent.nope :]), kl


def indexer_warmup(q, latent: Latent, *, indexer_out: IndexerOutput, segment_ids=None, scale=None):
    """The dense warm-up's indexer loss: q, `latent`, `indexer_out` and `segment_ids` as `sparse_attention` takes them
    -> [batch, length] float32, each query's KL divergence from the attention's distribution over every visible key
    (heads summed) to the softmax of their index scores, differentiable in `indexer_out` only. The attention's output is
    dense attention's (`parallel.attention`); split over context devices as `sparse_attention` is."""
    return _run(_warmup, q, latent, indexer_out, segment_ids, scale, attends=False)


def _run(local, q, latent: Latent, indexer_out: IndexerOutput, segment_ids, scale, *, attends: bool):
    """`local` on the absorbed queries [batch, length, heads, kv_lora + rope], the row's latent rows, `indexer_out` and
    segment ids: on one device, or on each device's piece with the row gathered; it returns (attention, loss) if
    `attends`, else the loss."""
    nope = latent.nope
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    absorbed = jnp.einsum("bthn,rhn->bthr", q[..., :nope], latent.kv_b[..., :nope]).astype(q.dtype)
    queries = jnp.concatenate([absorbed, q[..., nope:]], -1)
    seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    parallelism = current_parallelism()
    mesh = parallelism.mesh if parallelism.mesh is not None else jax.sharding.get_abstract_mesh()
    local = functools.partial(local, scale=scale)
    if mesh is None or mesh.empty:
        return local(queries, latent.tokens.grouped[0], indexer_out, *_row_tokens(seg, parallelism))
    return _sharded(local, mesh, parallelism, queries, latent.tokens, indexer_out, seg, attends)


def _row_tokens(seg, parallelism, axis=None, shards: int = 1, laid: int = 1):
    """A device's query tokens and the row's key tokens, from its segment ids [batch, n] (gathered over `axis` when
    the row is split in `shards`, in the parallelism's layout for `laid` ranks:
    parallel.strategies.common.layout_shards)
    -> (q_tokens, kv_tokens)."""
    order = global_index(seg.shape[1] * shards, parallelism, laid)
    if shards == 1:
        return Tokens(seg, jnp.asarray(order)), Tokens(seg, jnp.asarray(order))
    q_tokens = Tokens(seg, local_piece(order, shards, lax.axis_index(axis)))
    return q_tokens, Tokens(lax.all_gather(seg, axis, axis=1, tiled=True), jnp.asarray(order))


def _attend(
    queries, rows, indexer_out: IndexerOutput, q_tokens, kv_tokens, *, count, lora, scale, heads, heads_axis=None
):
    """Queries [batch, n, heads, kv_lora + rope] against the row's latent rows [batch, length, kv_lora + rope] over
    each query's selection -> (out in the latent's space [batch, n, heads, kv_lora], the indexer's loss [batch, n]);
    `heads` in all, split over `heads_axis` (if any), where their probabilities are summed."""
    indexer_q, indexer_k, indexer_w = indexer_out
    selection = top_k(indexer_q, indexer_w, indexer_k, q_tokens, kv_tokens, count=count, options=_blocks())
    # one key and value head, shared by every query head: the rows, whose first kv_lora features are the values
    out, probabilities = selected_attention.attention(queries, rows[:, :, None], lora, selection, scale=scale)
    if heads_axis is not None:
        probabilities = lax.psum(probabilities, heads_axis)
    return out, selection_kl(indexer_q, indexer_w, indexer_k, selection, probabilities / heads)


def _blocks() -> Options:
    """The selection's blocks, the parallelism's (parallel.block_q / block_kv): each block of block_q queries fills
    its row of scores block_kv keys at a time (the dense warm-up's loss walks the same blocks); large blocks make
    few kernels."""
    parallelism = current_parallelism()
    return Options(causal=True, block_q=parallelism.block_q, block_kv=parallelism.block_kv)


def _warmup(queries, rows, indexer_out: IndexerOutput, q_tokens, kv_tokens, *, scale, heads_axis=None):
    """The dense warm-up's loss [batch, n] of queries [batch, n, heads, kv_lora + rope] against the row's latent rows
    [batch, length, kv_lora + rope]; heads split over `heads_axis` (if any) are gathered."""
    if heads_axis is not None:
        queries = lax.all_gather(queries, heads_axis, axis=2, tiled=True)
    indexer_q, indexer_k, indexer_w = indexer_out
    return dense_kl(
        queries, rows[:, :, None], indexer_q, indexer_w, indexer_k, q_tokens, kv_tokens, scale=scale,
        options=_blocks(),
    )  # fmt: skip


def _sharded(local, mesh, parallelism, queries, tokens, indexer_out: IndexerOutput, seg, attends: bool):
    """`local` on each device's piece, length sharded over the parallelism's axis, batch and heads as the logical rules
    say; the row's latent rows, indexer keys and segment ids gathered -> its outputs (attention [batch, length, heads,
    kv_lora] if any, the loss [batch, length])."""
    axis = parallelism.axis
    q_spec, _, seg_spec = specs(mesh, axis)
    group = tensor.AXIS if tokens.shards > 1 else None
    rows_spec = PartitionSpec(group, *seg_spec, None)
    indexer_specs = (
        PartitionSpec(*seg_spec, None, None),
        PartitionSpec(*seg_spec, None),
        PartitionSpec(*seg_spec, None),
    )
    unit = lambda spec: mention_unit_axes(spec, mesh)
    in_specs = (unit(q_spec), unit(rows_spec), IndexerOutput(*map(unit, indexer_specs)), unit(seg_spec))
    shards, laid, heads_axis = axis_shards(mesh, axis), layout_shards(mesh, axis), logical_spec(("heads",), mesh)[0]
    heads_axis = heads_axis if heads_axis is not None and axis_shards(mesh, heads_axis) > 1 else None

    def run(queries, rows, indexer_out, seg):
        rows, keys = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (rows[0], indexer_out.keys))
        q_tokens, kv_tokens = _row_tokens(seg, parallelism, axis, shards, laid)
        return local(queries, rows, indexer_out._replace(keys=keys), q_tokens, kv_tokens, heads_axis=heads_axis)

    out_specs = (unit(q_spec), unit(seg_spec)) if attends else unit(seg_spec)
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
        queries, tokens.grouped, indexer_out, seg
    )
