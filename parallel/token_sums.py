"""Sums over tokens computed where the tokens are: each device reduces its own piece of the batch, one psum at the end.

The loss of a sharded sequence, chunked along the length under plain jit, moves every chunk between devices and
reduces each chunk's sums (the output kernel's gradient among them) inside the chunk loop. Run per device instead,
the chunk loop touches local tokens only, and the sums cross devices once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from parallel.mesh import logical_spec, spec_axes
from parallel.tensor import AXIS as TENSOR


def _token_spec(mesh, shape: tuple[int, ...]) -> PartitionSpec:
    """[batch, length, ...] split over every mesh axis that divides it: batch over the batch axes, length over the
    length axes and then `tensor` (whose devices hold the same tokens and would otherwise repeat the work)."""
    batch, length = logical_spec(("batch", "length"), mesh, shape[:2])
    length = spec_axes(length)
    pieces = shape[1] // math.prod(mesh.shape[axis] for axis in length)
    if mesh.shape.get(TENSOR, 1) > 1 and pieces % mesh.shape[TENSOR] == 0:
        length = (*length, TENSOR)
    return PartitionSpec(batch, (length[0] if len(length) == 1 else length) or None)


def token_sums(fn: Callable, tokens: tuple[jax.Array, ...], shared: tuple[jax.Array, ...] = ()):
    """fn(*tokens, *shared) -> a pytree of sums over the tokens, computed per device and psum'ed over the mesh.

    tokens: arrays [batch, length, ...] (the same batch and length each), split over the mesh; shared: arrays every
    device needs whole (e.g. the output kernel [embed, vocab]), whose gradients are summed over devices once.
    Without a mesh (or a mesh of one device) this is fn(*tokens, *shared).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(*tokens, *shared)
    spec = _token_spec(mesh, tokens[0].shape)
    axes = tuple(axis for part in spec if part is not None for axis in ((part,) if isinstance(part, str) else part))

    def local(*arrays):
        if not axes:
            return fn(*arrays)
        # varying from here: the shared arrays' gradients sum over devices at this point, once, not in fn's loops
        whole = [jax.lax.pcast(x, axes, to="varying") for x in arrays[len(tokens) :]]
        return jax.lax.psum(fn(*arrays[: len(tokens)], *whole), axes)

    in_specs = (spec,) * len(tokens) + (PartitionSpec(),) * len(shared)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(), check_vma=True)(
        *tokens, *shared
    )
