"""Stacks of blocks: created with nnx.vmap (parameters get a leading `layers` axis) and run with lax.scan under the
configured remat policy, so compile time does not grow with depth.

A stack of one kind of layer is one stacked block (`make_stack`). A stack whose layers differ (`layer_types`) is
`Segments`, cut as models/groups.py says: each segment a stack of `Group`s holding one block per position of its
period; the remat policy applies to each block. `make_layers` / `run_layers` / `stacked_blocks` take either."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from models.groups import segments
from models.remat import remat

MakeBlock = Callable[[str, nnx.Rngs], nnx.Module]  # (layer kind, rngs) -> block


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


class Group(nnx.Module):
    """One block per kind of `kinds`, attributes block0, block1, ...: what one step of a segment's scan runs."""

    def __init__(self, make_block: MakeBlock, kinds: tuple[str, ...], rngs: nnx.Rngs):
        self.size = len(kinds)
        for position, kind in enumerate(kinds):
            setattr(self, f"block{position}", make_block(kind, rngs))

    def __call__(self, x, *args, remat_policy: str):
        """x through each block in turn, each under the remat policy -> (x, (each block's extra, in order))."""
        extras = []
        for position in range(self.size):
            graphdef, state = nnx.split(getattr(self, f"block{position}"))
            x, extra = remat(lambda h, s, g=graphdef: nnx.merge(g, s)(h, *args), remat_policy)(x, state)
            extras.append(extra)
        return x, tuple(extras)


class Segments(nnx.Module):
    """The segments of a stack whose layers differ: attributes segment0, segment1, ..., each `repeats` Groups of its
    kinds stacked on a leading `layers` axis."""

    def __init__(self, make_block: MakeBlock, kinds: tuple[str, ...], rngs: nnx.Rngs):
        self.segments = segments(kinds)
        for index, segment in enumerate(self.segments):
            group = make_stack(lambda r, s=segment: Group(make_block, s.kinds, r), segment.repeats, rngs)
            setattr(self, f"segment{index}", group)

    def __call__(self, x, *args, remat_policy: str):
        """x through every segment -> (x, extras stacked on a leading axis in layer order; None from dense blocks)."""
        extras = []
        for index in range(len(self.segments)):
            graphdef, stacked = nnx.split(getattr(self, f"segment{index}"))

            def body(h, group, g=graphdef):
                return nnx.merge(g, group)(h, *args, remat_policy=remat_policy)

            x, extra = jax.lax.scan(body, x, stacked)  # extra: per position, [repeats, ...]
            extras.append(jax.tree.map(lambda *e: jnp.stack(e, 1).reshape(-1, *e[0].shape[1:]), *extra))
        return x, jax.tree.map(lambda *e: jnp.concatenate(e), *extras)


def make_layers(make_block: MakeBlock, kinds: tuple[str, ...], rngs: nnx.Rngs) -> nnx.Module:
    """The blocks of a stack of layers of `kinds` (one per layer): one stacked block when they are all alike (the
    parameter layout of a stack of one kind), else Segments."""
    if len(set(kinds)) == 1:
        return make_stack(lambda r: make_block(kinds[0], r), len(kinds), rngs)
    return Segments(make_block, kinds, rngs)


def run_layers(layers: nnx.Module, x, *args, remat_policy: str):
    """x: [batch, length, embed] through `make_layers`' blocks -> (x, their extras stacked in layer order)."""
    if isinstance(layers, Segments):
        return layers(x, *args, remat_policy=remat_policy)
    return run_stack(layers, x, *args, remat_policy=remat_policy)


def block_layout(kinds: tuple[str, ...]) -> list[tuple[tuple[str, ...], list[int]]]:
    """(path of a stacked block within `make_layers(..., kinds, ...)`, the stack's index of each slice of its leading
    axis) for each of its stacked blocks: ((), every layer) for layers all alike, else (segment<i>, block<j>) of
    Segments."""
    if len(set(kinds)) == 1:
        return [((), list(range(len(kinds))))]
    return [
        ((f"segment{index}", f"block{position}"), segment.layers(position))
        for index, segment in enumerate(segments(kinds))
        for position in range(len(segment.kinds))
    ]


def stacked_blocks(layers: nnx.Module, kinds: tuple[str, ...]) -> Iterator[tuple[nnx.Module, list[int]]]:
    """(a stacked block of `make_layers`' blocks of `kinds`, the stack's index of each of its slices) for each."""
    for path, indices in block_layout(kinds):
        block = layers
        for name in path:
            block = getattr(block, name)
        yield block, indices
