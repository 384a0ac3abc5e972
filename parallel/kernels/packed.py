"""What the kernels on packed rows (cuDNN's, parallel/kernels/cudnn.py, and FlashAttention-3's,
parallel/kernels/flash3.py) share: the kinds of call they serve, each row's segment slots, and the run-time switch
that sends every other call to the general kernel.

A packed kernel knows documents as runs of the row (per-segment lengths and offsets) and causality as each run's own,
not global token indices. So it serves a call whose queries and keys are each in increasing global order, and that is
the causal DIAGONAL (queries and keys one token set) or ALL_VISIBLE within segments (non-causal, or every key precedes
every query); a dual_chunk or contiguous ring step is one of these by construction (parallel/strategies/ring_steps.py).
Static indices compile only their kind and the general kernel; traced ones every kind the call could be. A row's
query ids may span at most m slots (segment id s in slot s - the row's smallest query id); a row with more runs the
general kernel, a run-time branch. Whatever derives from the segment ids alone passes through an optimization barrier
with q (`tied`, `full`, `where`), so that under remat it is recomputed with the layer rather than kept as a residual
of the switch (parallel/kernels/cudnn.py's docstring tells what that cost).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel.anchored import full
from parallel.kernels.arguments import Options, Tokens
from parallel.rounding import round_up
from parallel.segments import INT32_MAX, seqlens_offsets

DIAGONAL, ALL_VISIBLE, GENERAL = 0, 1, 2


class Unservable(ValueError):
    """A call a packed kernel cannot serve: global indices its masks cannot express, or inputs it does not take."""


class Metadata(NamedTuple):
    """Packed-row metadata in the primitive's convention, and where each token sits in it."""

    q_seqlen: jax.Array  # [batch, m] int32, -1 for an empty slot
    kv_seqlen: jax.Array  # [batch, m]
    q_offsets: jax.Array  # [batch, m + 1] int32 first token of each slot, -1 for empty slots and the last column
    kv_offsets: jax.Array  # [batch, m + 1]
    q_row: jax.Array  # [batch, tq] int32 stats row of the token's segment, batch * m if in none
    q_pos: jax.Array  # [batch, tq] int32 position within the segment
    q_valid: jax.Array  # [batch, tq] bool: in a served segment
    kv_valid: jax.Array  # [batch, tk] bool


def call_kind(q_index, kv_index, causal: bool):
    """[tq], [tk] global indices -> DIAGONAL or ALL_VISIBLE when both are static (numpy, or concrete outside
    jit), None when one is traced (the kind is then decided at run time); raises Unservable for any other static
    pattern, or a static side that is not increasing. Every served call has increasing indices on both sides, so
    each document is one run of the row (what packed metadata describes). A static DIAGONAL still needs the same
    segment ids on both sides at run time (see _switch)."""
    q, kv = known_at_trace_time(q_index), known_at_trace_time(kv_index)
    if any(side is not None and not increasing(side) for side in (q, kv)):
        raise Unservable(
            "attention kernels on packed rows (cudnn, flash3) need query and key tokens in increasing global order "
            "(each document one run of the row); these global indices are not"
        )
    if q is None or kv is None:
        return None
    if not causal:
        return ALL_VISIBLE
    if q.shape == kv.shape and (q == kv).all():
        return DIAGONAL
    if kv.max() <= q.min():
        return ALL_VISIBLE
    raise Unservable(
        "attention kernels on packed rows (cudnn, flash3) serve the causal diagonal (same increasing indices) or "
        "keys that all precede the queries; these global indices are neither"
    )


def known_at_trace_time(index):
    """[t] indices -> numpy when known at trace time (numpy, or concrete outside jit), else None (traced)."""
    try:
        return np.asarray(index)
    except jax.errors.TracerArrayConversionError:
        return None


def increasing(index) -> bool:
    """[t] indices (numpy or traced) -> (traced) bool: strictly increasing."""
    return jnp.all(jnp.diff(index) > 0) if isinstance(index, jax.Array) else bool(np.all(np.diff(index) > 0))


def runtime_kind(q: Tokens, kv: Tokens, causal: bool = True):
    """Traced call_kind of two sides' tokens (traced [t] indices, [batch, t] ids) -> int32 DIAGONAL, ALL_VISIBLE or
    GENERAL."""
    (q_seg, q_index), (kv_seg, kv_index) = q, kv
    ordered = increasing(q_index) & increasing(kv_index)
    all_visible = ordered & ((jnp.max(kv_index) <= jnp.min(q_index)) | (not causal))
    if q_index.shape != kv_index.shape or q_seg.shape != kv_seg.shape or not causal:
        return jnp.where(all_visible, ALL_VISIBLE, GENERAL)
    diagonal = ordered & jnp.all(q_index == kv_index) & jnp.all(q_seg == kv_seg)
    return jnp.where(diagonal, DIAGONAL, jnp.where(all_visible, ALL_VISIBLE, GENERAL))


def _base(q_seg):
    """[batch, tq] ids -> [batch, 1] int32: one below the row's smallest query id (slot s = id - base)."""
    return jnp.min(jnp.where(q_seg > 0, q_seg, INT32_MAX), axis=1, keepdims=True) - 1


def too_many_segments(q_seg, max_segments: int):
    """[batch, tq] ids -> bool scalar: some row's query ids span more than `max_segments` slots."""
    return jnp.any((q_seg > 0) & (q_seg - _base(q_seg) > max_segments))


def metadata(q_seg, kv_seg, max_segments: int) -> Metadata:
    """q_seg [batch, tq], kv_seg [batch, tk] int32 segment ids (0 = padding) -> Metadata with m = max_segments
    (query ids spanning at most max_segments slots: see too_many_segments)."""
    batch, tq = q_seg.shape
    base = _base(q_seg)

    def slot(seg):
        """[batch, t] ids -> [batch, t] slots 1.. relative to the row's smallest query id, 0 below it or padding."""
        return jnp.where((seg > 0) & (seg > base), seg - base, 0)

    q_slot, kv_slot = slot(q_seg), slot(kv_seg)
    q_pos = jnp.broadcast_to(jnp.arange(tq, dtype=jnp.int32), q_seg.shape)  # index along the row
    q_len, kv_len, q_off, kv_off = seqlens_offsets(q_slot, kv_slot, max_segments=max_segments)
    filled = q_len > 0  # padding mask: a slot has queries iff it has keys
    rank = (jnp.cumsum(filled.reshape(-1)) - 1).reshape(filled.shape)

    def lookup(table, slots):
        """table [batch, m], slots [batch, t] (1-based) -> [batch, t] entries."""
        return jnp.take_along_axis(table, jnp.clip(slots - 1, 0, max_segments - 1), axis=1)

    def valid(slots):
        """[batch, t] slots -> [batch, t] bool: in a slot that has both queries and keys."""
        return (slots > 0) & (slots <= max_segments) & lookup(filled, slots)

    q_valid = valid(q_slot)
    end = jnp.full((batch, 1), -1, jnp.int32)
    return Metadata(
        q_seqlen=jnp.where(filled, q_len, -1),
        kv_seqlen=jnp.where(filled, kv_len, -1),
        q_offsets=jnp.concatenate([jnp.where(filled, q_off, -1), end], axis=1),
        kv_offsets=jnp.concatenate([jnp.where(filled, kv_off, -1), end], axis=1),
        q_row=jnp.where(q_valid, lookup(rank, q_slot), batch * max_segments),
        q_pos=jnp.where(q_valid, q_pos - lookup(q_off, q_slot), 0),
        q_valid=q_valid,
        kv_valid=valid(kv_slot),
    )


def pad_last(x, width: int):
    """x [..., d] zero-padded to [..., width]."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def width(dqk: int, dv: int, extra: int) -> int:
    """One head width for Q, K, V: the larger of dqk and dv + extra, rounded up to a multiple of 8."""
    return round_up(max(dqk, dv + extra), 8)


def check_width(kernel: str, q, dv: int, dlse_columns: int, *, any_dtype: bool = False) -> int:
    """The padded width of `kernel`'s call on q [b, t, h, dqk] and a value head dim dv with `dlse_columns` for the
    lse cotangent (2 in a backward given one, else 0); raises Unservable unless it is at most 256 and q is 16-bit
    (any dtype where `any_dtype`: a stand-in's)."""
    padded = width(q.shape[-1], dv, dlse_columns)
    if (not any_dtype and q.dtype not in (jnp.bfloat16, jnp.float16)) or padded > 256:
        raise Unservable(
            f"attention kernel '{kernel}' takes bfloat16 or float16 inputs of one padded head width <= 256, not "
            f"{q.dtype} of width {padded} (q/k head dim {q.shape[-1]}, v head dim {dv}, {dlse_columns} columns for "
            f"the lse cotangent)"
        )
    return padded


def switch(kind, q: Tokens, kv: Tokens, causal: bool, max_segments: int, by_kind: dict, *operands, unserved=None):
    """Runs by_kind[k](*operands) for the call's kind k: the static `kind` (then only it and GENERAL are compiled; a
    DIAGONAL whose query and key segment ids differ is GENERAL), or the kind decided from the traced indices of
    sides q and kv when None (only the kinds the call's shapes allow are compiled: a non-causal call is ALL_VISIBLE
    or GENERAL, the DIAGONAL needs as many keys as queries); GENERAL (the general kernel) when a row has more
    segments than max_segments, or where `unserved(q_seg, kv_seg)` (a traced bool; None: never)."""
    (q_seg, q_index), (kv_seg, kv_index) = q, kv
    if kind is None:
        same_shapes = causal and q_index.shape == kv_index.shape and q_seg.shape == kv_seg.shape
        kind, kinds = runtime_kind(q, kv, causal), (DIAGONAL,) * same_shapes + (ALL_VISIBLE, GENERAL)
    elif kind == DIAGONAL:
        kind, kinds = jnp.where(jnp.all(q_seg == kv_seg), DIAGONAL, GENERAL), (DIAGONAL, GENERAL)
    else:
        kinds = (kind, GENERAL)
    general = too_many_segments(q_seg, max_segments)
    if unserved is not None:
        general |= unserved(q_seg, kv_seg)
    kind = jnp.where(general, GENERAL, kind)
    position = jnp.argmax(jnp.asarray(kinds) == kind)
    return lax.switch(position, [by_kind[k] for k in kinds], *operands)


def with_dlse(out, dout, dlse, q_valid, width: int, dtype):
    """out, dout [b, tq, h, dv] -> both in `dtype`, zero-padded to `width`, and given dlse [b, tq, h] (None: none)
    carrying it in the two columns after dv: a packed kernel's backward computes delta_i = dout_i . out_i itself,
    and d score_ij = p_ij (dp_ij - (delta_i - dlse_i)) (parallel.kernels.blockwise.backward). So dout = 1 and out =
    -hi, -lo there, hi + lo = dlse (hi in `dtype`, lo the remainder), with V zero there: dp is unchanged, delta
    gains -dlse, and the matching dV columns are dropped. Queries outside `q_valid` [b, tq] carry none."""
    dv = out.shape[-1]
    out, dout = pad_last(out.astype(dtype), width), pad_last(dout.astype(dtype), width)
    if dlse is None:
        return out, dout
    dlse = where(q_valid[..., None], dlse, 0)
    hi = dlse.astype(dtype)
    lo = (dlse.astype(jnp.float32) - hi.astype(jnp.float32)).astype(dtype)
    out = out.at[..., dv].set(-hi).at[..., dv + 1].set(-lo)
    return out, dout.at[..., dv : dv + 2].set(full(dout, (), 1, dtype))


def tied(q, *segment_ids):
    """(q, *segment_ids) through one optimization barrier: what derives from the ids alone (metadata, token masks
    broadcast to q's size) then derives from q too, so it is recomputed with the layer (module docstring)."""
    return lax.optimization_barrier((q, *segment_ids))


def where(valid, x, value):
    """x where `valid` (broadcast), else `value`, the fill made from x (`full`): recomputed with the layer."""
    return jnp.where(valid, x, full(x, (), value, x.dtype))


def forward(served, q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, max_segments: int, general,
            unserved=None):  # fmt: skip
    """(out [b, tq, h, dv] in q's dtype, lse [b, tq, h] float32) of a packed kernel: served(kind, q, k, v, q_seg,
    kv_seg) for the call's kind (see switch; `unserved(q_seg, kv_seg)`, None or a traced bool, adds rows it cannot
    serve), `general` (parallel.kernels.blockwise.forward's signature) for the rest. Raises Unservable for static
    indices no packed kernel masks (call_kind)."""
    kind = call_kind(q_tokens.index, kv_tokens.index, options.causal)

    def general_call(q, k, v, q_seg, kv_seg):
        """The general kernel on the same operands."""
        sides = (q_tokens._replace(segment_ids=q_seg), kv_tokens._replace(segment_ids=kv_seg))
        return general(q, k, v, *sides, options=options, out_dtype=q.dtype)

    by_kind = {DIAGONAL: functools.partial(served, DIAGONAL), ALL_VISIBLE: functools.partial(served, ALL_VISIBLE)}
    by_kind[GENERAL] = general_call
    q, *segment_ids = tied(q, q_tokens.segment_ids, kv_tokens.segment_ids)
    operands = (q, k, v, *segment_ids)
    return switch(kind, q_tokens, kv_tokens, options.causal, max_segments, by_kind, *operands, unserved=unserved)


def backward(served, q, k, v, q_tokens: Tokens, kv_tokens: Tokens, out, lse, dout, dlse, *, options: Options,
             grad_dtype, accumulate, max_segments: int, general, unserved=None):  # fmt: skip
    """(dq, dk, dv) of a packed kernel, as parallel.kernels.blockwise.backward gives them (in `grad_dtype`, or added
    into `accumulate`): served(kind, q, k, v, q_seg, kv_seg, out, lse, dout, dlse) -> float32 grads for the call's
    kind, `general` (a backward) for the rest; `unserved` and errors as in `forward`."""
    kind = call_kind(q_tokens.index, kv_tokens.index, options.causal)

    def general_call(q, k, v, q_seg, kv_seg, out, lse, dout, dlse):
        """The general kernel on the same operands: float32 (dq, dk, dv)."""
        sides = (q_tokens._replace(segment_ids=q_seg), kv_tokens._replace(segment_ids=kv_seg))
        return general(q, k, v, *sides, out, lse, dout, dlse, options=options, grad_dtype=jnp.float32)

    def kind_of(kind):
        """The served backward of `kind` as a switch branch (operands as `general_call`'s)."""
        return lambda *a: served(kind, *a)

    by_kind = {DIAGONAL: kind_of(DIAGONAL), ALL_VISIBLE: kind_of(ALL_VISIBLE), GENERAL: general_call}
    q, *segment_ids = tied(q, q_tokens.segment_ids, kv_tokens.segment_ids)
    operands = (q, k, v, *segment_ids, out, lse, dout, dlse)
    grads = switch(kind, q_tokens, kv_tokens, options.causal, max_segments, by_kind, *operands, unserved=unserved)
    if accumulate is not None:
        return tuple((total + g).astype(total.dtype) for total, g in zip(accumulate, grads, strict=True))
    return tuple(g.astype(grad_dtype or x.dtype) for g, x in zip(grads, (q, k, v), strict=True))
