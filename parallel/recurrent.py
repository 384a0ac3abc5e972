"""Gated DeltaNet's sequence operations over a row split across context devices: the short causal convolution and
the gated delta rule (parallel/kernels/gated_delta.py), equal to one device on any layout and on packed rows.

A device's rows are pieces of the row: runs of consecutive tokens (dual_chunk: two per device; contiguous: one; the
whole row in the layout when the sequence is not split). Only two things cross pieces, both from the pieces before
in original order:
- the convolution's last `kernel - 1` input rows (with their segment ids, so taps across a document start are zero):
  each piece's tail is all-gathered (pieces x (kernel - 1) rows, a few hundred KiB a layer at 128K);
- the recurrence's state: each piece first runs from [I | 0] on values [0 | v] and reports its map [M | E],
  S_out = M S_in + E, for the document that continues past its start (M = 0 when one starts inside it); one
  all-gather of the maps (pieces x heads x dk x (dk + dv) float32; float64 given float64) and a fold in original
  order give every piece its incoming state, from which it runs again for its outputs. A document start cuts the
  chain, as M = 0 does.
The backward is the kernel's own (it recomputes each chunk's terms, parallel/kernels/gated_delta.py) and autodiff
through the exchanges (the gathers' transposes send the gradients home).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from parallel.kernels import gated_delta as kernel
from parallel.mesh import logical_spec
from parallel.parallelism import current_parallelism
from parallel.strategies.common import axis_names, axis_shards, global_index, layout_shards, mention_unit_axes

NO_SEGMENT = -1  # the segment id of rows before the row's start: no real token has it


@dataclasses.dataclass(frozen=True)
class Pieces:
    """How a row of `length` tokens lies over `shards` devices (`axis`, None when it is not split): each device holds
    `per_device` pieces of `size` consecutive tokens; `order[d, j]` is the original position (0 = the row's start)
    of device d's piece j."""

    axis: tuple[str, ...] | None
    shards: int
    per_device: int
    size: int
    order: np.ndarray  # [shards, per_device] int32

    @property
    def by_position(self) -> np.ndarray:
        """[pieces]: the flattened (device, slot) of the piece at each original position."""
        return np.argsort(self.order, axis=None)

    def rank(self):
        """This device's index along the split axes (0 when the row is not split); inside the shard_map."""
        return 0 if self.axis is None else _rank(self.axis)


def pieces(length: int, parallelism, mesh) -> Pieces:
    """The pieces of a row in `parallelism`'s layout, split over its axis under every strategy but `none` (usp: both
    axes, laid out over the ring axis)."""
    split = parallelism.strategy != "none" and mesh is not None and not mesh.empty
    names = axis_names(parallelism.axis)
    shards = axis_shards(mesh, names) if split else 1
    laid = 1 if mesh is None or mesh.empty else layout_shards(mesh, parallelism.axis)
    index = global_index(length, parallelism, laid)
    fine = index.reshape(max(shards, laid), -1)  # a device's rows, or the layout's rank's when finer
    cuts = np.unique(
        np.concatenate([np.flatnonzero(np.diff(r, prepend=-2) != 1) for r in fine])
    )  # where any run starts
    cuts = (np.arange(len(fine) // shards)[:, None] * fine.shape[1] + cuts).ravel()  # in a device's rows
    rows = index.reshape(shards, -1)
    sizes = np.diff(np.append(cuts, rows.shape[1]))
    if np.any(sizes != sizes[0]):
        raise ValueError(
            f"layout {parallelism.layout!r} over {shards} devices gives pieces of unequal sizes {sizes.tolist()}"
        )
    first = rows[:, cuts]  # [shards, per_device] original index of each piece's first token
    order = np.argsort(np.argsort(first, axis=None)).reshape(first.shape).astype(np.int32)
    return Pieces(names if split else None, shards, len(cuts), int(sizes[0]), order)


def causal_conv(xs, weights, segment_ids=None, *, mesh=None):
    """Depthwise causal convolutions over the (possibly split and reordered) sequence, taps within each document, of
    several arrays at once (one exchange for all).

    xs: arrays [batch, length, heads, d] (heads and d may differ between them), weights: one [taps, heads, d] each
    (tap taps - 1 multiplies the token itself, tap j the token taps - 1 - j before it: Hugging Face's Conv1d weight
    [channels, 1, taps] transposed), segment_ids: [batch, length] (None = one document) -> the convolved arrays, in
    xs' shapes and dtype."""
    parallelism, mesh = _parallelism_and_mesh(mesh)
    layout = pieces(xs[0].shape[1], parallelism, mesh)
    taps = weights[0].shape[0]

    def local(*operands):
        *xs, seg = operands
        xs, weights = xs[: len(xs) // 2], xs[len(xs) // 2 :]
        channels = [x.shape[2:] for x in xs]
        x = jnp.concatenate([x.reshape(*x.shape[:2], -1) for x in xs], axis=-1)  # [batch, n, channels]
        weight = jnp.concatenate([w.reshape(taps, -1) for w in weights], axis=-1).astype(x.dtype)
        pieces_x, segs = _split(x, layout), _split(seg, layout)
        before, before_seg = _before(pieces_x, segs, taps - 1, layout)
        xe, se = jnp.concatenate([before, pieces_x], axis=2), jnp.concatenate([before_seg, segs], axis=2)
        size, out, reach = layout.size, 0, True
        for distance in range(taps):  # a tap counts while no document starts between it and the token
            j = taps - 1 - distance
            reach = reach & (se[:, :, j : j + size] == segs)
            out = out + jnp.where(reach[..., None], xe[:, :, j : j + size], 0) * weight[j]
        out = jnp.split(_join(out), np.cumsum([np.prod(c) for c in channels])[:-1], axis=-1)
        return tuple(o.reshape(*o.shape[:2], *c) for o, c in zip(out, channels, strict=True))

    return _sharded(local, layout, mesh, tuple(xs), segment_ids, weights=tuple(weights), every_output=True)


def gated_delta(q, k, v, g, beta, segment_ids=None, *, chunk: int = kernel.CHUNK, mesh=None):
    """The gated delta rule over the (possibly split and reordered) sequence, the state reset at document starts.

    q, k: [batch, length, heads, dk] (q scaled, both L2-normalised), v: [batch, length, heads, dv], g (log decay):
    [batch, length, heads], beta: [batch, length, heads], segment_ids: [batch, length] (None = one document) ->
    [batch, length, heads, dv] in v's dtype."""
    parallelism, mesh = _parallelism_and_mesh(mesh)
    layout = pieces(q.shape[1], parallelism, mesh)

    def whole_row(q, k, v, g, beta, seg):
        """The row in original order (static moves of the layout's pieces there and back), one run from zero."""
        q, k, v, g, beta, seg = (_join(_split(x, layout)[:, layout.by_position]) for x in (q, k, v, g, beta, seg))
        zero = jnp.zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]), kernel.compute_dtype(k, v))
        start = jnp.full(seg.shape[:1], NO_SEGMENT, seg.dtype)
        out, _ = kernel.chunked(q, k, v, g, beta, seg, state=zero, start_seg=start, chunk=chunk)
        return _join(_split(out, layout)[:, layout.order[0]]).astype(v.dtype)

    def local(q, k, v, g, beta, seg):
        q, k, v, g, beta, segs = (_split(x, layout) for x in (q, k, v, g, beta, seg))
        start = _before(None, segs, 1, layout)[1][:, :, 0]  # [batch, per_device]: the id of each piece's previous token
        flat = lambda x: x.reshape(-1, *x.shape[2:])  # pieces as rows of the batch
        maps = kernel.affine_map(*map(flat, (k, v, g, beta, segs)), start_seg=flat(start), chunk=piece_chunk)
        state = _incoming(maps, layout, q.shape[:2], v.shape[-1])
        run = dict(state=state, start_seg=flat(start), chunk=piece_chunk)
        out, _ = kernel.chunked(*map(flat, (q, k, v, g, beta, segs)), **run)
        return _join(out.reshape(*q.shape[:3], *out.shape[2:])).astype(v.dtype)

    piece_chunk = min(chunk, layout.size)  # a piece shorter than a chunk is one chunk
    return _sharded(whole_row if layout.axis is None else local, layout, mesh, (q, k, v, g, beta), segment_ids)


def _parallelism_and_mesh(mesh):
    """The installed parallelism and the mesh it runs on (the argument, else the parallelism's, else
    `jax.set_mesh`'s)."""
    parallelism = current_parallelism()
    mesh = (
        mesh
        if mesh is not None
        else parallelism.mesh
        if parallelism.mesh is not None
        else jax.sharding.get_abstract_mesh()
    )
    return parallelism, mesh


def _split(x, layout: Pieces):
    """A device's rows [batch, n, ...] -> its pieces [batch, per_device, size, ...]."""
    return x.reshape(x.shape[0], layout.per_device, layout.size, *x.shape[2:])


def _join(x):
    """[batch, per_device, size, ...] -> [batch, per_device * size, ...]."""
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _before(xs, segs, width: int, layout: Pieces):
    """The `width` rows before each of this device's pieces in original order and their segment ids: xs [batch,
    per_device, size, ...] (or None: the ids only), segs [batch, per_device, size] -> ([batch, per_device, width, ...]
    or None, [batch, per_device, width]); rows before the row's start are zeros of segment NO_SEGMENT. Every piece's
    tail is gathered from every device, put in original order behind `width` such rows, and each piece reads the
    `width` rows before its own."""
    tail = min(width, layout.size)
    firsts = jnp.asarray(layout.order * tail)[
        layout.rank()
    ]  # [per_device]: each piece's first row in the gathered tails

    def read(a, fill):
        """The rows before each local piece of a [batch, per_device, size, ...]."""
        a = a[:, :, layout.size - tail :]
        if layout.axis is not None:
            a = lax.all_gather(a, layout.axis, axis=1, tiled=True)  # [batch, pieces, tail, ...]
        a = a[:, layout.by_position].reshape(a.shape[0], -1, *a.shape[3:])  # in original order
        a = jnp.concatenate([jnp.full((a.shape[0], width, *a.shape[2:]), fill, a.dtype), a], axis=1)
        return jnp.stack([lax.dynamic_slice_in_dim(a, f, width, axis=1) for f in firsts], axis=1)

    return None if xs is None else read(xs, 0), read(segs, NO_SEGMENT)


def _incoming(maps, layout: Pieces, shape, value_dim: int):
    """Each of this device's pieces' incoming state from every piece's map [M | E] [rows, heads, dk, dk + dv] (rows =
    batch x per_device) -> [rows, heads, dk, dv]: the maps gathered, folded in original order from a zero state
    (S <- M S + E), each piece taking the state before its own."""
    batch, per_device = shape
    maps = maps.reshape(batch, per_device, *maps.shape[1:])
    if layout.axis is not None:
        maps = lax.all_gather(maps, layout.axis, axis=1, tiled=True)
    ordered = jnp.moveaxis(maps[:, layout.by_position], 1, 0)  # [pieces, batch, heads, dk, dk + dv]

    def fold(state, piece):
        return piece[..., :-value_dim] @ state + piece[..., -value_dim:], state

    _, before = lax.scan(fold, jnp.zeros_like(ordered[0, ..., -value_dim:]), ordered)  # [pieces, batch, heads, dk, dv]
    mine = jnp.take(before, jnp.asarray(layout.order)[layout.rank()], axis=0)  # [per_device, batch, ...]
    return jnp.moveaxis(mine, 0, 1).reshape(batch * per_device, *mine.shape[2:])


def _rank(names: tuple[str, ...]):
    """This device's index along the product of mesh axes `names` (first name major)."""
    rank = 0
    for name in names:
        rank = rank * lax.axis_size(name) + lax.axis_index(name)
    return rank


def _sharded(local, layout: Pieces, mesh, arrays, segment_ids, weights=(), every_output=False):
    """local(*arrays, *weights, seg) on each device's rows: arrays [batch, length, heads, ...], weights [taps, heads,
    d], segment_ids [batch, length] or None (one document). The length is split over layout.axis, batch and heads by
    the logical rules; `local` returns one array shaped as arrays[0], or with `every_output` one shaped as each of
    `arrays`. Without a mesh `local` runs on the whole row."""
    seg = jnp.ones(arrays[0].shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    operands = (*arrays, *weights, seg)
    if mesh is None or mesh.empty:
        return local(*operands)
    batch, heads = logical_spec(("batch",), mesh)[0], logical_spec(("heads",), mesh)[0]
    spec = lambda x: mention_unit_axes(PartitionSpec(batch, layout.axis, heads, *([None] * (x.ndim - 3))), mesh)
    weight_spec, seg_spec = PartitionSpec(None, heads, None), PartitionSpec(batch, layout.axis)
    in_specs = (*map(spec, arrays), *(mention_unit_axes(weight_spec, mesh) for _ in weights))
    in_specs = (*in_specs, mention_unit_axes(seg_spec, mesh))
    out_specs = tuple(map(spec, arrays)) if every_output else spec(arrays[0])
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*operands)
