"""A stack of identical blocks: created with nnx.vmap (parameters get a leading `layers` axis) and run with
lax.scan under the configured remat policy, so compile time does not grow with depth."""

from __future__ import annotations

import jax
from flax import nnx

from models.remat import remat


def make_stack(make_block, count: int, rngs: nnx.Rngs) -> nnx.Module:
    """`count` blocks from `make_block(rngs)`, parameters stacked on a leading axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(rngs):
        return make_block(rngs)

    return make(rngs)


def run_stack(stack: nnx.Module, x, *args, remat_policy: str):
    """x: [batch, length, embed] through every block `block(x, *args) -> (x, extra)`; returns (x, extras stacked
    on a leading layer axis)."""
    graphdef, stacked = nnx.split(stack)

    def body(h, layer):
        return nnx.merge(graphdef, layer)(h, *args)

    return jax.lax.scan(remat(body, remat_policy), x, stacked)
