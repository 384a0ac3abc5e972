"""Context parallelism with a sliding window by halo exchange: a query of global index i sees only keys in (i - W, i],
so each device needs, beyond its own piece, just the keys its queries' windows reach into other devices' pieces
(the halo), not every piece (the ring) nor the whole sequence (all_gather).

Which rows each device sends to which is static, numpy from the layout's global index, W and the device count: one
collective permute per distance d between devices (source s sends to s + d) that any device needs keys over,
carrying K, V and segment ids of just those rows, padded to the most any device needs at that distance. In the
dual_chunk layout with W - 1 up to a chunk that is two permutes of W - 1 tokens (each chunk's tail to the device
holding the next chunk: the next rank for the first chunks, the previous one for the second); in contiguous, one.
Each device then runs the kernel on its own piece (overlapping the exchange) and on the halo, merged by log-sum-exp
in float32, with the sinks applied once to the merge. The backward runs both calls' kernel backward with the merged
out and lse, as a ring step does (so only the merged output is kept, not each call's), and sends the halo's dK / dV
home by the same permutes reversed, added into the rows they came from. When the halo would be no smaller than what
the strategy moves without it (striped layouts, windows reaching most of the row), `shifts` says None and the
strategy runs as before.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel import anchored, kernels
from parallel.kernels import Options, Tokens, saved
from parallel.kernels import sinks as attention_sinks
from parallel.lse_merge import merge
from parallel.segments import INT32_MAX
from parallel.strategies.common import RowTerms, chosen_kernel, kernel, local_piece


class Shift(NamedTuple):
    """The halo rows that travel a distance d (each source s to s + d): numpy, fixed at trace time."""

    pairs: tuple[tuple[int, int], ...]  # (source, destination) of the devices that exchange anything
    rows: np.ndarray  # [shards, width] int32: the local rows each device sends (repeated past its count)
    index: np.ndarray  # [shards, width] int32: global index of the rows each device receives (INT32_MAX: padding)


def shifts(index: np.ndarray, shards: int, window: int | None) -> tuple[Shift, ...] | None:
    """The halo exchange of a sequence in a layout whose global index is `index` [length] (piece r = rows
    r * n .. (r + 1) * n - 1) over `shards` devices, for a window of `window` tokens; None when there is no window,
    one device, or the halo is no smaller than the (shards - 1) pieces the ring and all_gather bring each device."""
    if window is None or shards == 1:
        return None
    length = index.size
    pieces = index.reshape(shards, -1)
    ranks = np.arange(shards)[:, None]
    owner, row = np.empty(length, np.int32), np.empty(length, np.int32)
    owner[pieces], row[pieces] = ranks, np.arange(pieces.shape[1])[None, :]
    marks = np.zeros((shards, length + 1), np.int32)  # +1 where a query's window opens, -1 past its end
    np.add.at(marks, (ranks, np.maximum(pieces - window + 1, 0)), 1)
    np.add.at(marks, (ranks, pieces + 1), -1)
    needed = (np.cumsum(marks, axis=1)[:, :length] > 0) & (owner[None, :] != ranks)  # [shards, length]
    found = []
    for distance in range(1, shards):
        keys = [np.flatnonzero(needed[r] & (owner == (r - distance) % shards)) for r in range(shards)]
        width = max(len(g) for g in keys)
        if width:
            found.append(_shift(keys, distance, width, row))
    if sum(s.rows.shape[1] for s in found) >= (shards - 1) * pieces.shape[1]:
        return None
    return tuple(found)


def _shift(keys: list[np.ndarray], distance: int, width: int, row: np.ndarray) -> Shift:
    """The Shift of `distance` from keys[r], the sorted global indices device r needs from device r - distance."""
    shards = len(keys)
    rows = np.zeros((shards, width), np.int32)
    index = np.full((shards, width), INT32_MAX, np.int32)
    pairs = []
    for r, g in enumerate(keys):
        if len(g):
            source = (r - distance) % shards
            pairs.append((source, r))
            rows[source] = np.concatenate([row[g], np.full(width - len(g), row[g[-1]])])
            index[r, : len(g)] = g
    return Shift(tuple(pairs), rows, index)


class Residuals(NamedTuple):
    """What the halo attention's backward keeps of its forward, on each device."""

    q: jax.Array  # [batch, n, heads, dqk] local queries
    kv: tuple[jax.Array, jax.Array]  # (k, v) [batch, n, kv_heads, d] of the local piece
    halo_kv: tuple[jax.Array, jax.Array]  # (k, v) [batch, width, kv_heads, d]: the received rows, all shifts
    seg: jax.Array  # [batch, n] int32 segment ids of the local piece
    halo_seg: jax.Array  # [batch, width] int32 of the received rows (0: padding)
    out: jax.Array  # [batch, n, heads, dv] merged output in q's dtype
    lse: jax.Array  # [batch, n, heads] float32 merged log-sum-exp


def halo_local(
    q, k, v, seg, sinks, *, axis, shards: int, index, found: tuple[Shift, ...], options: Options, parallelism
):
    """Inside a shard_map over `axis` (shards devices): q [batch, n, heads, dqk], k/v [batch, n, kv_heads, d] and
    seg [batch, n] are this device's piece, sinks [heads] or None; index: numpy [shards * n] global token index of
    every piece in order; found: shifts(index, shards, options.window). -> out [batch, n, heads, dv], the sinks
    applied once to the merge of the own piece's and the halo's attention. The backward runs each call's kernel
    backward with the merged lse and the rows' terms (common.RowTerms, as a ring step does) and sends the halo's
    dK / dV home."""
    pieces = index.reshape(shards, -1)
    each_rank = functools.partial(_each_rank, axis, shards, chosen_kernel(parallelism).name in kernels.FIXED_MASKS)
    if not found:  # every window within the own piece

        def own_only(r):
            own = Tokens(seg, _piece(pieces, r))
            return kernel(q, k, v, own, own, options=options, parallelism=parallelism)

        return attention_sinks.apply(*each_rank(own_only), sinks)
    impl = chosen_kernel(parallelism)
    received_index = np.concatenate([shift.index for shift in found], axis=1)

    def grad_dtype(x):
        return jnp.float32 if parallelism.ring_grad_dtype == "float32" else x.dtype

    def sides(seg, halo_seg, r):
        """(own tokens, halo tokens) at rank r (traced, or an int): the local piece's and the received rows' segment
        ids and global indices."""
        return Tokens(seg, _piece(pieces, r)), Tokens(halo_seg, _piece(received_index, r))

    def run_forward(q, kv, seg):
        """((out in q's dtype, lse float32), Residuals)."""
        rank = lax.axis_index(axis)
        received = [lax.ppermute(_rows(shift.rows, (*kv, seg), rank), axis, shift.pairs) for shift in found]
        halo_k, halo_v, halo_seg = (jnp.concatenate(parts, axis=1) for parts in zip(*received, strict=True))
        halo_seg = jnp.where(jnp.asarray(received_index)[rank] < INT32_MAX, halo_seg, 0)

        def both(r):
            own, halo = sides(seg, halo_seg, r)
            out, lse = impl.forward(q, *kv, own, own, options=options, out_dtype=jnp.float32)
            far = impl.forward(q, halo_k, halo_v, own, halo, options=options, out_dtype=jnp.float32)
            return merge(out, lse, *far)

        out, lse = each_rank(both)
        out, lse = saved.named(out.astype(q.dtype), lse)
        return (out, lse), Residuals(q, kv, (halo_k, halo_v), seg, halo_seg, out, lse)

    @jax.custom_vjp
    def attend(q, kv, seg):
        return run_forward(q, kv, seg)[0]

    def attend_bwd(res: Residuals, cotangents):
        dout, dlse = cotangents
        dlse = None if sinks is None else dlse  # only the sinks use the lse
        terms = RowTerms.of(impl, res.out, dout, dlse)
        # zeros made from dout: from nothing, XLA would make them before the forward, live through it
        zeros = lambda arrays: tuple(anchored.full(dout, x.shape, 0, grad_dtype(x)) for x in arrays)

        def both(r):
            own, halo = sides(res.seg, res.halo_seg, r)
            grads = (anchored.full(dout, res.q.shape, 0, jnp.float32), *zeros(res.kv))
            dq, dk, dv = terms.backward(
                impl, res.q, *res.kv, own, own, res.lse, dout, options=options, accumulate=grads
            )
            halo_grads = (dq, *zeros(res.halo_kv))
            dq, dk_far, dv_far = terms.backward(
                impl, res.q, *res.halo_kv, own, halo, res.lse, dout, options=options, accumulate=halo_grads
            )
            return dq, dk, dv, dk_far, dv_far

        dq, dk, dv, dk_far, dv_far = each_rank(both)
        dk, dv = _send_home(found, (dk, dv), (dk_far, dv_far), axis)
        return dq.astype(res.q.dtype), (dk.astype(res.kv[0].dtype), dv.astype(res.kv[1].dtype)), None

    attend.defvjp(run_forward, attend_bwd)
    return attention_sinks.apply(*attend(q, (k, v), seg), sinks)


def _piece(table: np.ndarray, rank):
    """Row `rank` of `table` [shards, width]: numpy for an int rank, else traced."""
    return table[rank] if isinstance(rank, int) else local_piece(table.reshape(-1), table.shape[0], rank)


def _each_rank(axis, shards: int, fixed: bool, call):
    """call(rank) with the device's traced rank over `axis`; or, when the kernel's masks are `fixed` at trace time
    (splash), a switch over call(0) ... call(shards - 1), each with its rank's indices static."""
    rank = lax.axis_index(axis)
    if not fixed:
        return call(rank)
    return lax.switch(rank, [functools.partial(call, r) for r in range(shards)])


def _rows(rows: np.ndarray, arrays, rank):
    """The rows `rows[rank]` of each of `arrays` ([batch, n, ...]) -> [batch, width, ...] each."""
    chosen = jnp.asarray(rows)[rank]
    return tuple(jnp.take(x, chosen, axis=1) for x in arrays)


def _send_home(found: tuple[Shift, ...], grads, halo_grads, axis):
    """grads (dk, dv) [batch, n, kv_heads, d] of the local piece plus the halo's (dk, dv) [batch, width, ...], each
    shift's rows sent back to the device they came from and added into the rows they were taken from."""
    rank = lax.axis_index(axis)
    start = 0
    for shift in found:
        width = shift.rows.shape[1]
        back = tuple((target, source) for source, target in shift.pairs)
        arriving = lax.ppermute(tuple(g[:, start : start + width] for g in halo_grads), axis, back)
        rows = jnp.asarray(shift.rows)[rank]
        grads = tuple(g.at[:, rows].add(a) for g, a in zip(grads, arriving, strict=True))
        start += width
    return grads
