"""DeepSeek sparse attention (DSA, DeepSeek-V3.2 and GLM-5): the indexer's scores choose each query's `count` best
visible keys (parallel.kernels.top_k) and attention reads only those (parallel.kernels.sparse). MLA's latent is the
one key and value every head shares there (the absorbed form DeepSeek runs), so a query block gathers
kv_lora + rope numbers per selected key, not heads x (nope + rope + dv). Over context devices the row's index keys
and latents are gathered (see sparse_attention). (A row no longer than `count` selects every visible key: that is
dense attention, which models run with `parallel.attention`.)"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from parallel import tensor
from parallel.kernels import Options, Tokens
from parallel.kernels import sparse as sparse_kernel
from parallel.kernels.top_k import top_k
from parallel.latent import Latent
from parallel.plan import current_plan
from parallel.strategies.common import axis_shards, global_index, local_piece, mention_unit_axes, specs


class Index(NamedTuple):
    """The indexer's output for each token: queries [batch, length, heads, d], keys [batch, length, d] and weights
    [batch, length, heads] float32 (the scales folded in); score[s, t] = sum_h weights[s, h] relu(q[s, h] . k[t])."""

    queries: jax.Array
    keys: jax.Array
    weights: jax.Array


# the top-k's blocks: 64 queries keep a running top-k, merged with the scores of 256 keys at a time
SELECTION_OPTIONS = Options(causal=True, block_q=64, block_kv=256)


def sparse_attention(q, latent: Latent, *, index: Index, count: int, segment_ids=None, scale=None):
    """Causal MLA of each query over the `count` visible keys of highest index score. q [batch, length, heads,
    nope + rope], MLA's `latent` (parallel.Latent), `segment_ids` [batch, length] (0 = padding) -> [batch, length,
    heads, dv]; arrays in the plan's sequence layout (parallel.plan), length sharded over its axis.

    Split over context devices (any strategy: the selection may pick keys anywhere before the query), each device
    gathers the row's index keys [length, d] and latents [length, kv_lora + rope] and scores its own queries
    against every key: the latents move as a ring's rotation moves them, the index keys d / (kv_lora + rope) more
    (128 / 576 in DeepSeek-V3.2); the backward reduce-scatters the latents' gradient."""
    lora, nope = latent.kv_b.shape[0], latent.nope
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    absorbed = jnp.einsum("bthn,rhn->bthr", q[..., :nope], latent.kv_b[..., :nope]).astype(q.dtype)
    queries = jnp.concatenate([absorbed, q[..., nope:]], -1)  # [batch, length, heads, kv_lora + rope]
    seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    plan = current_plan()
    mesh = plan.mesh if plan.mesh is not None else jax.sharding.get_abstract_mesh()
    attend = functools.partial(_local, count=count, scale=scale, lora=lora, plan=plan)
    if mesh is None or mesh.empty:
        out = attend(queries, latent.tokens.grouped[0], *index, seg, shards=1)
    else:
        out = _sharded(attend, mesh, plan.axis, queries, latent.tokens, index, seg)
    return jnp.einsum("bthr,rhd->bthd", out, latent.kv_b[..., nope:])


def _local(queries, rows, index_q, index_k, weights, seg, *, count, scale, lora, plan, shards, axis=None):
    """One device's queries [batch, n, heads, kv_lora + rope] against the row: rows [batch, n, kv_lora + rope],
    the indexer's queries, keys and weights, segment ids [batch, n] of its piece (the whole row when `shards` is 1),
    gathered over `axis` -> the attention output in the latent's space [batch, n, heads, kv_lora]."""
    length = seg.shape[1] * shards
    order = global_index(length, plan, shards)
    if shards > 1:
        rows, index_k, seg_all = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (rows, index_k, seg))
        q_tokens = Tokens(seg, local_piece(order, shards, lax.axis_index(axis)))
    else:
        seg_all, q_tokens = seg, Tokens(seg, jnp.asarray(order))
    kv_tokens = Tokens(seg_all, jnp.asarray(order))
    selection = top_k(index_q, weights, index_k, q_tokens, kv_tokens, count=count, options=SELECTION_OPTIONS)
    keys = rows[:, :, None]  # one key and value head, shared by every query head
    return sparse_kernel.attention(queries, keys, keys[..., :lora], selection, scale=scale)[0]


def _sharded(attend, mesh, axis, queries, tokens, index: Index, seg):
    """`attend` on each device's piece, length sharded over `axis`, batch and heads as the logical rules say."""
    q_spec, _, seg_spec = specs(mesh, axis)
    group = tensor.AXIS if tokens.shards > 1 else None
    rows_spec = PartitionSpec(group, *seg_spec, None)
    index_specs = (PartitionSpec(*seg_spec, None, None), PartitionSpec(*seg_spec, None), PartitionSpec(*seg_spec, None))
    in_specs = tuple(mention_unit_axes(spec, mesh) for spec in (q_spec, rows_spec, *index_specs, seg_spec))
    shards = axis_shards(mesh, axis)

    def local(queries, rows, index_q, index_k, weights, seg):
        return attend(queries, rows[0], index_q, index_k, weights, seg, shards=shards, axis=axis)

    out_spec = mention_unit_axes(q_spec, mesh)
    run = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)
    return run(queries, tokens.grouped, *index, seg)
