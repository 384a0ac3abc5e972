"""Embedding lookup where the table stays sharded: no device gathers the table, the tokens move instead.

The table [vocab, embed] is split like every parameter: embed over fsdp and the sequence axes (ZeRO-3), vocab over
`tensor`. A plain `take` gives rows sharded like the table's embed, and XLA cannot reshard those to the residual
stream's [batch over fsdp, length over the sequence axes] except by replicating them (an "involuntary full
rematerialization", and its transpose in the backward). Inside one shard_map instead, each device
1. all-gathers the token ids over the table's embed axes (int32, a few MiB),
2. looks up its own embed slice of every gathered token (ids outside its vocab rows give zeros, summed over
   `tensor`: a reduce-scatter where the tokens are split over `tensor`, else a psum),
3. sends each device the slices of its own tokens with one all-to-all over the embed axes.
The backward is the transposed all-to-all and a scatter-add into the local table shard.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from parallel.mesh import logical_spec, spec_axes
from parallel.tensor import token_layout


def lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """table [vocab, embed], tokens [batch, length] int -> [batch, length, embed] in `dtype`, in the residual
    stream's layout. Without a mesh, or for tokens that do not split over it (a sampled prompt), a plain `take`."""
    mesh = jax.sharding.get_abstract_mesh()
    layout = token_layout(mesh, (*tokens.shape, table.shape[1]))
    if layout is None:
        return jnp.take(table, tokens, axis=0).astype(dtype)
    spec, token_axes, _ = layout
    vocab, embed = (spec_axes(entry) for entry in logical_spec(("vocab", "embed"), mesh, table.shape))
    split_vocab = tuple(a for a in vocab if a in token_axes)  # tensor ranks that hold different tokens
    pieces = math.prod(mesh.shape[a] for a in embed)

    def local(table, ids):
        batch, length = ids.shape
        ids = jax.lax.all_gather(ids.reshape(-1), embed + split_vocab, tiled=True) if embed + split_vocab else ids
        if vocab:  # only this device's vocab rows: the others' ids give zero rows
            rows = table.shape[0]
            ids = ids.reshape(-1) - jax.lax.axis_index(vocab) * rows
            inside = (ids >= 0) & (ids < rows)
            found = jnp.where(inside[:, None], jnp.take(table, jnp.where(inside, ids, 0), axis=0), 0).astype(dtype)
        else:
            found = jnp.take(table, ids.reshape(-1), axis=0).astype(dtype)
        found = found.reshape(pieces, -1, found.shape[-1])  # [embed devices, their tokens, local embed]
        if split_vocab:
            found = jax.lax.psum_scatter(found, split_vocab, scatter_dimension=1, tiled=True)
        if set(vocab) - set(split_vocab):
            found = jax.lax.psum(found, tuple(a for a in vocab if a not in split_vocab))
        if embed:
            found = jax.lax.all_to_all(found, embed, 0, 2, tiled=True)
        return found.reshape(batch, length, -1)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(PartitionSpec(vocab or None, embed or None), PartitionSpec(*spec[:2])),
        out_specs=spec,
        check_vma=True,
    )(table, tokens)
