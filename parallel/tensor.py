"""Scattered tensor parallelism: between blocks the residual stream is sharded on length over mesh axis `tensor`.

A column-parallel projection (heads or MLP hidden sharded over `tensor`) starts from `gather(x)`: one all-gather
of the scattered tokens. A row-parallel projection ends in `project_scatter`: its partial sums over `tensor` are
reduce-scattered back onto the scattered tokens. Both collectives are explicit (shard_map), so every backend
compiles a reduce-scatter, never an all-reduce, and their transposes (reduce-scatter of the input gradient,
all-gather of the output gradient) come out of autodiff.

Inside, the gathered tokens carry a leading `group` axis, one entry per tensor shard, sharded over `tensor`
(each device its own copy), and the sharded dimension of a kernel is split into (group, rest): the projections
then never sum over devices in the partitioned program, and the sums happen only in the explicit collectives.
Without a mesh, with tensor = 1 or with the parallelism's `scatter` off, these are plain einsums and GSPMD places the
collectives (all-reduce tensor parallelism).
"""

from __future__ import annotations

import math
import string

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from parallel.mesh import logical_spec, spec_axes
from parallel.parallelism import current_parallelism

AXIS = "tensor"


def tensor_shards() -> int:
    """Size of mesh axis `tensor` (1 without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.shape.get(AXIS, 1)


def scatter_shards() -> int:
    """Number of tensor-parallel ranks the residual stream is scattered over (1 = not scattered)."""
    return tensor_shards() if current_parallelism().scatter else 1


def token_specs(ndim: int) -> tuple[PartitionSpec, PartitionSpec]:
    """(scattered [batch, length, ...], gathered with a leading group axis [group, batch, length, ...]) specs."""
    mesh = jax.sharding.get_abstract_mesh()
    batch, length = logical_spec(("batch", "length"), mesh)
    length = spec_axes(length)
    rest = (None,) * (ndim - 2)
    return PartitionSpec(batch, (*length, AXIS), *rest), PartitionSpec(AXIS, batch, length or None, *rest)


class Tokens:
    """All tokens of the local sequence pieces, gathered over `tensor` from the scattered residual stream: feed
    column-parallel projections with `project` and per-head copies with `per_head`. Made by `gather`."""

    def __init__(self, grouped: jax.Array):
        """grouped: [group, batch, length, features], group = tensor ranks (sharded over `tensor`) or 1."""
        self.grouped = grouped
        self.shards = grouped.shape[0]

    def features(self, start: int, stop: int | None = None) -> Tokens:
        """The same tokens restricted to features [start, stop)."""
        return Tokens(self.grouped[..., start:stop])

    def map(self, fn) -> Tokens:
        """The same tokens with fn [batch, length, features] -> [batch, length, features'] applied to each group's
        copy (a per-token function, e.g. a rotary embedding of some features)."""
        return Tokens(jax.vmap(fn)(self.grouped))

    def project(self, equation: str, kernel: jax.Array, split: str, *, repeat: bool = False) -> jax.Array:
        """Column-parallel einsum `equation` ("bt<x>,<kernel>-><out>", tokens first) whose kernel dimension
        lettered `split` is sharded over `tensor`, e.g. project("bte,ehd->bthd", wq, split="h") -> [batch,
        length, heads, head_dim]. repeat: when that dimension does not divide into the groups, repeat each of its
        entries just enough (GQA key/value heads: the output then has more, repeated, heads)."""
        inputs, out = equation.split("->")
        x_letters, k_letters = inputs.split(",")
        axis = k_letters.index(split)
        size, shards = kernel.shape[axis], tensor_shards()
        if size % shards:
            if not repeat:
                raise ValueError(
                    f"dimension {split!r} of size {size} of {equation!r} does not split over "
                    f"mesh.tensor={shards}; make it divisible by {shards}"
                )
            kernel = jnp.repeat(kernel, shards // math.gcd(size, shards), axis=axis)
        g = _free_letter(equation)
        kernel = _split_axis(kernel, axis, self.shards)
        y = jnp.einsum(
            f"{g}{x_letters},{k_letters.replace(split, g + split)}->{out.replace(split, g + split)}",
            self.grouped,
            kernel,
        )
        return _merge_axis(y, out.index(split))

    def per_head(self, num_heads: int) -> jax.Array:
        """[batch, length, features] -> [batch, length, num_heads, features], the same features for every head
        (heads sharded over `tensor`; in the backward pass the heads' gradients sum before the reduce-scatter)."""
        g, b, t, f = self.grouped.shape
        heads = jnp.broadcast_to(self.grouped.transpose(1, 2, 0, 3)[:, :, :, None], (b, t, g, num_heads // g, f))
        return heads.reshape(b, t, num_heads, f)


def gather(x: jax.Array) -> Tokens:
    """x [batch, length, features] from the residual stream (length scattered over `tensor` when `scatter_shards()` > 1)
    -> `Tokens` holding every token of the local pieces: one all-gather over `tensor`."""
    if scatter_shards() == 1:
        return Tokens(x[None])
    scattered, gathered = token_specs(x.ndim)

    def local(piece):
        return jax.lax.all_gather(piece, AXIS, axis=1, tiled=True)[None]

    mesh = jax.sharding.get_abstract_mesh()
    return Tokens(jax.shard_map(local, mesh=mesh, in_specs=scattered, out_specs=gathered, check_vma=True)(x))


def residual_spec() -> PartitionSpec:
    """Sharding of the residual stream [batch, length, embed] on the current mesh: length over context x ulysses,
    and over `tensor` too when scattered."""
    if scatter_shards() > 1:
        return token_specs(3)[0]
    return logical_spec(("batch", "length", "embed"), jax.sharding.get_abstract_mesh())


def token_layout(mesh, shape: tuple[int, ...]):
    """(residual stream spec, mesh axes that split the tokens, mesh axes that hold copies of them) for x [batch,
    length, embed] of `shape` on a mesh of several devices, when its batch splits over the batch axes and its length
    over the length axes and the copies; else None."""
    if mesh.empty or mesh.size == 1:
        return None
    spec = residual_spec()
    token_axes = tuple(a for entry in spec for a in spec_axes(entry))
    replicated = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in token_axes)
    batch_parts = math.prod(mesh.shape[a] for a in spec_axes(spec[0]))
    length_parts = math.prod(mesh.shape[a] for a in spec_axes(spec[1]) + replicated)
    return None if shape[0] % batch_parts or shape[1] % length_parts else (spec, token_axes, replicated)


def residual(x: jax.Array) -> jax.Array:
    """Constrains the residual stream x [batch, length, embed] to `residual_spec()` when a mesh is set."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, residual_spec())


def project_scatter(equation: str, x: jax.Array, kernel: jax.Array, split: str) -> jax.Array:
    """Row-parallel einsum `equation` ("bt...,...->bt...", contracting the dimension lettered `split` that is
    sharded over `tensor` in x and kernel), its partial sums reduce-scattered onto the scattered tokens, e.g.
    project_scatter("bthd,hde->bte", attn, wo, split="h") -> [batch, length, embed]."""
    shards = scatter_shards()
    if shards == 1:
        return jnp.einsum(equation, x, kernel)
    inputs, out = equation.split("->")
    x_letters, k_letters = inputs.split(",")
    g = _free_letter(equation)
    x = _split_axis(x, x_letters.index(split), shards)
    kernel = _split_axis(kernel, k_letters.index(split), shards)
    partial = jnp.einsum(
        f"{x_letters.replace(split, g + split)},{k_letters.replace(split, g + split)}->{g}{out}", x, kernel
    )  # [group, batch, length, ...]: one partial sum per tensor rank
    scattered, gathered = token_specs(partial.ndim - 1)

    def local(piece):
        return jax.lax.psum_scatter(piece[0], AXIS, scatter_dimension=1, tiled=True)

    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(local, mesh=mesh, in_specs=gathered, out_specs=scattered, check_vma=True)(partial)


def _free_letter(equation: str) -> str:
    return next(c for c in string.ascii_letters if c not in equation)


def _split_axis(x: jax.Array, axis: int, parts: int) -> jax.Array:
    """Splits dimension `axis` into (parts, size / parts)."""
    return x.reshape(*x.shape[:axis], parts, x.shape[axis] // parts, *x.shape[axis + 1 :])


def _merge_axis(x: jax.Array, axis: int) -> jax.Array:
    """Merges dimensions (axis, axis + 1) back into one."""
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2 :])
