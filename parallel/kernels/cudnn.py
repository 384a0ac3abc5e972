"""cuDNN flash attention on packed rows (THD: per-segment lengths and offsets), behind the kernel interface.

It calls JAX's cuDNN primitives directly (jax._src.cudnn.fused_attention_stablehlo, through parallel/compat.py), not
the public wrapper, whose VJP drops the softmax statistics' cotangent. What the primitives give and this module adapts:

- Masks: cuDNN knows segments (from seqlens / offsets) and top-left causality within a segment, not global token
  indices. So a call is served only when queries and keys are each in increasing global order (then every
  document is one run of the row), and is the causal DIAGONAL (queries and keys one token set: PADDING_CAUSAL) or
  ALL_VISIBLE within segments (non-causal, or every key precedes every query: PADDING); a dual_chunk or contiguous
  ring step is one of these by construction (parallel/strategies/ring_steps.py). Anything else is `Unservable` when
  the indices are static (the selected kernel then runs its general kernel: Pallas on GPU), and runs that general
  kernel (a `lax.switch` branch) when they are traced or the row has more segments than `max_segments`. Static
  indices compile only their kind and that fallback; traced ones compile every kind the call could be.
- Metadata: a row's segment id s occupies slot s - (smallest query id of the row); each segment must be one
  contiguous run of the row (documents are; so are a load-balanced piece's, which keeps global order). A row's
  query ids may span at most m ids: a call with more runs the general kernel (a run-time branch). cuDNN pads every
  slot to the call's length: its backward keeps a float32 dq accumulator and two float32 statistics per slot x head x
  query, batch x m x heads x tq x (width + 2) x 4 bytes (128 GiB for 64 slots of a 128K-token row of 32 heads of
  128). So m is as many slots as fit in `slot_bytes` (4 GiB), at least 2 and at most `max_segments`. Empty slots are
  -1 in both seqlens and offsets (a 0 length would stay in the primitive's left-shifted list while its -1 offset
  leaves it).
- GQA: where JAX's packed binding strides key / value offsets by the key heads (JAX 0.11 on; found by feature:
  parallel.compat.cudnn_packed_gqa), K / V keep their own heads and dK / dV come back per key head. JAX 0.10.2
  strides them by the QUERY head count, so there K / V are repeated to the query heads and dK / dV summed back over
  each group (four times the K / V bytes read at 32 / 8 heads).
- Head dims: the primitive uses one offset list for K and V and one for Q and O, in elements of Q's head dim; so
  Q, K and V are zero-padded to one width (a multiple of 8) and out / grads sliced back (MLA included, with no
  cuDNN 9.10 requirement).
- Statistics: the forward's second output is the natural-log lse of the scaled scores, float32
  [batch * max_segments, heads, tq]: row = the segment's rank among the non-empty slots of all rows, column = the
  position within the segment. It maps to and from lse [batch, tq, heads].
- Tokens in no segment come back as garbage: out / grads zeroed there, lse = -inf.
- dlse: the backward computes delta_i = dout_i . out_i itself, and d score_ij = p_ij (dp_ij - (delta_i - dlse_i))
  (parallel.kernels.blockwise.backward). So two extra value features carry it exactly: dout = 1 and out = -hi, -lo with
  hi + lo = dlse (hi in the input dtype, lo the remainder), V = 0 there, so dp is unchanged, delta gains -dlse,
  and the matching dV columns are dropped.
- Sliding windows: the primitive's window counts positions within a segment of the packed layout, which is the
  global window only on the diagonal of an unsplit document; a ring step or a load-balanced chunk is neither, so
  every windowed call runs the general kernel.
- Residuals under remat: a call inside a rematerialised layer scan (a ring step's, say) is partially evaluated by
  JAX, which computes early what it can: a constant, or anything derived from the segment ids alone (the same for
  every layer), becomes a residual of the call's switch, stacked per ring step and kept through the backward pass.
  At full size (the token masks broadcast to the output, the zeros a branch returns) that was 12 GiB a device for
  DeepSeek-V3 at 128K on 16 context devices. So the ids pass through an optimization barrier with q (`_tied`) and
  every full-size constant is derived from an operand (`_full`, `_where`): recomputed with the layer instead.
- Unused operands: the binds take a bias and two page tables this module never uses (no bias in variadic_args, and
  paging only for rank-4 tables), so their lowering drops them. They are one element, not zero (JAX's own wrapper
  passes zero-element arrays): JAX's partial evaluation can turn them into operands of the strategy's shard_map
  (the grad of a layer scan hoists what depends only on the loop-invariant segment ids out of the loop; under the
  ring's step scan they stack to [steps, 0]), and XLA's Shardy import in JAX 0.11 segfaults on a manual computation
  with a zero-element operand it has folded to a constant (ManualComputationUnusedInputsPattern).

`Primitives` holds the two primitive binds; tests pass a dense stand-in with the same signature.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel import compat
from parallel.kernels import blockwise
from parallel.kernels.arguments import Options, Tokens
from parallel.segments import INT32_MAX, seqlens_offsets

fa = compat.cudnn_attention()
DIAGONAL, ALL_VISIBLE, GENERAL = 0, 1, 2
MASKS = {DIAGONAL: fa.MaskType.PADDING_CAUSAL, ALL_VISIBLE: fa.MaskType.PADDING}
MAX_SEGMENTS = 64
SLOT_BYTES = 4 << 30  # cuDNN's per-slot buffers of one call (see slots)
UNUSED_SHAPE = (1,)  # the binds' unused bias / page-table operands: one element, never zero (module docstring)


class Unservable(ValueError):
    """A call whose global indices cuDNN's masks cannot express."""


class Primitives(NamedTuple):
    """forward / backward with the binds' signatures: fa._dot_product_attention_fwd_p_wrapper.bind (10 operands,
    then scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length, is_training) ->
    [out, stats]; the bwd wrapper's bind (the same 10, stats, out, dout; the same keywords less is_training) ->
    [dq, dk, dv]."""

    forward: object
    backward: object


CUDNN = Primitives(*compat.cudnn_binds())


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
    if any(side is not None and not _increasing(side) for side in (q, kv)):
        raise Unservable(
            "attention kernel 'cudnn' needs query and key tokens in increasing global order (each document one run "
            "of the row); these global indices are not"
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
        "attention kernel 'cudnn' serves the causal diagonal (same increasing indices) or keys that all precede the "
        "queries; these global indices are neither"
    )


def known_at_trace_time(index):
    """[t] indices -> numpy when known at trace time (numpy, or concrete outside jit), else None (traced)."""
    try:
        return np.asarray(index)
    except jax.errors.TracerArrayConversionError:
        return None


def _increasing(index) -> bool:
    """[t] indices (numpy or traced) -> (traced) bool: strictly increasing."""
    return jnp.all(jnp.diff(index) > 0) if isinstance(index, jax.Array) else bool(np.all(np.diff(index) > 0))


def runtime_kind(q: Tokens, kv: Tokens, causal: bool = True):
    """Traced call_kind of two sides' tokens (traced [t] indices, [batch, t] ids) -> int32 DIAGONAL, ALL_VISIBLE or
    GENERAL."""
    (q_seg, q_index), (kv_seg, kv_index) = q, kv
    increasing = _increasing(q_index) & _increasing(kv_index)
    all_visible = increasing & ((jnp.max(kv_index) <= jnp.min(q_index)) | (not causal))
    if q_index.shape != kv_index.shape or q_seg.shape != kv_seg.shape or not causal:
        return jnp.where(all_visible, ALL_VISIBLE, GENERAL)
    diagonal = increasing & jnp.all(q_index == kv_index) & jnp.all(q_seg == kv_seg)
    return jnp.where(diagonal, DIAGONAL, jnp.where(all_visible, ALL_VISIBLE, GENERAL))


def _base(q_seg):
    """[batch, tq] ids -> [batch, 1] int32: one below the row's smallest query id (slot s = id - base)."""
    return jnp.min(jnp.where(q_seg > 0, q_seg, INT32_MAX), axis=1, keepdims=True) - 1


def slots(q_shape, dv: int, max_segments: int = MAX_SEGMENTS, slot_bytes: int = SLOT_BYTES) -> int:
    """Segment slots of a call with queries of q_shape [batch, tq, heads, dqk] and value head dim dv: as many as keep
    cuDNN's float32 per-slot buffers (batch x slots x heads x tq x (padded width + 2)) within slot_bytes, at least 2
    (one slot is the primitive's unpacked layout, which ignores offsets) and at most max_segments."""
    batch, tq, heads, dqk = q_shape
    per_slot = batch * tq * heads * (_width(dqk, dv, 2) + 2) * 4
    return max(2, min(max_segments, slot_bytes // per_slot))


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


def lse_from_stats(stats, meta: Metadata):
    """stats [batch * m, heads, tq] float32 -> lse [batch, tq, heads], -inf for tokens in no segment."""
    lse = stats[jnp.minimum(meta.q_row, stats.shape[0] - 1), :, meta.q_pos]
    return _where(meta.q_valid[..., None], lse, -jnp.inf)


def stats_from_lse(lse, meta: Metadata, rows: int):
    """lse [batch, tq, heads] -> stats [rows, heads, tq] float32 (zeros where no token maps)."""
    stats = _full(lse, (rows, lse.shape[2], lse.shape[1]), 0, jnp.float32)
    return stats.at[meta.q_row, :, meta.q_pos].set(lse.astype(jnp.float32), mode="drop")


def _pad_last(x, width: int):
    """x [..., d] zero-padded to [..., width]."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _width(dqk: int, dv: int, extra: int) -> int:
    """One head width for Q, K, V: the larger of dqk and dv + extra, rounded up to a multiple of 8."""
    return -(-max(dqk, dv + extra) // 8) * 8


def _group(q, k) -> int:
    """How many times K / V heads are repeated for the primitive: 1 where the binding takes GQA as it is (module
    docstring), else query heads / key heads."""
    return 1 if compat.cudnn_packed_gqa() else q.shape[2] // k.shape[2]


def _operands(q, k, v, width: int):
    """q [b, tq, h, dqk], k [b, tk, hkv, dqk], v [b, tk, hkv, dv] -> the three padded to `width`, k / v with their
    heads repeated `_group` times."""
    group = _group(q, k)
    return (
        _pad_last(q, width),
        _pad_last(jnp.repeat(k, group, axis=2), width),
        _pad_last(jnp.repeat(v, group, axis=2), width),
    )


def _switch(kind, q: Tokens, kv: Tokens, causal: bool, max_segments: int, by_kind: dict, *operands):
    """Runs by_kind[k](*operands) for the call's kind k: the static `kind` (then only it and GENERAL are compiled; a
    DIAGONAL whose query and key segment ids differ is GENERAL), or the kind decided from the traced indices of
    sides q and kv when None (only the kinds the call's shapes allow are compiled: a non-causal call is ALL_VISIBLE
    or GENERAL, the DIAGONAL needs as many keys as queries); GENERAL (the general kernel) when a row has more
    segments than max_segments."""
    (q_seg, q_index), (kv_seg, kv_index) = q, kv
    if kind is None:
        same_shapes = causal and q_index.shape == kv_index.shape and q_seg.shape == kv_seg.shape
        kind, kinds = runtime_kind(q, kv, causal), (DIAGONAL,) * same_shapes + (ALL_VISIBLE, GENERAL)
    elif kind == DIAGONAL:
        kind, kinds = jnp.where(jnp.all(q_seg == kv_seg), DIAGONAL, GENERAL), (DIAGONAL, GENERAL)
    else:
        kinds = (kind, GENERAL)
    kind = jnp.where(too_many_segments(q_seg, max_segments), GENERAL, kind)
    position = jnp.argmax(jnp.asarray(kinds) == kind)
    return lax.switch(position, [by_kind[k] for k in kinds], *operands)


def _tied(q, *segment_ids):
    """(q, *segment_ids) through one optimization barrier: what derives from the ids alone (metadata, token masks
    broadcast to q's size) then derives from q too, so it is recomputed with the layer (module docstring)."""
    return lax.optimization_barrier((q, *segment_ids))


def _full(anchor, shape, value, dtype):
    """jnp.full(shape, value, dtype) derived from the operand `anchor`, so it is recomputed where it is used rather
    than kept as a residual of the call's switch (module docstring)."""
    return jnp.broadcast_to(lax.optimization_barrier((anchor, jnp.asarray(value, dtype)))[1], shape)


def _where(valid, x, value):
    """x where `valid` (broadcast), else `value`, the fill derived from x (see _full)."""
    return jnp.where(valid, x, _full(x, (), value, x.dtype))


def _params(kind: int, scale: float) -> dict:
    """The binds' keyword parameters for a call of `kind`."""
    return dict(
        scale=float(scale),
        seed=42,
        dropout_rate=0.0,
        variadic_args=(False, False),
        mask_type=MASKS[kind],
        layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=None,
    )


def _check(q, dv: int, primitives: Primitives):
    """q [b, tq, h, dqk], value head dim dv: raises Unservable for inputs the real primitives reject (not 16-bit, or
    a padded head width past 256, the dlse columns included); where a GPU is present, JAX's own flash-attention
    check of the padded operands."""
    if primitives is not CUDNN:
        return
    width = _width(q.shape[-1], dv, 2)
    if q.dtype not in (jnp.bfloat16, jnp.float16) or width > 256:
        raise Unservable(
            f"attention kernel 'cudnn' takes bfloat16 or float16 inputs of one padded head width <= 256, not "
            f"{q.dtype} of width {width} (q/k head dim {q.shape[-1]}, v head dim {dv}, 2 columns for the lse "
            f"cotangent)"
        )
    if jax.default_backend() == "gpu":
        padded = jax.ShapeDtypeStruct((*q.shape[:3], width), q.dtype)
        version = fa.check_cudnn_version()
        fa.check_is_flash_attention(padded, padded, padded, fa.AttentionLayout.BTNH.value, version, False, True, True)


def _unused(dtype):
    """The binds' bias and page-table operands, which no served call uses (the lowering drops them): one element, so
    that no zero-element array can become a shard_map operand (module docstring)."""
    return jnp.zeros(UNUSED_SHAPE, dtype)


def _served_forward(kind, q, k, v, q_seg, kv_seg, *, scale, max_segments, primitives):
    """One served kind: (out [b, tq, h, dv] in q's dtype, lse [b, tq, h] float32)."""
    dv = v.shape[-1]
    meta = metadata(q_seg, kv_seg, max_segments)
    qp, kp, vp = _operands(q, k, v, _width(q.shape[-1], dv, 0))
    unused = _unused(q.dtype)
    out, stats = primitives.forward(
        qp, kp, vp, unused, meta.q_seqlen, meta.kv_seqlen, meta.q_offsets, meta.kv_offsets, unused, unused,
        **_params(kind, scale), is_training=True,
    )  # fmt: skip
    out = _where(meta.q_valid[..., None, None], out[..., :dv], 0).astype(q.dtype)
    return out, lse_from_stats(stats, meta)


def _served_backward(kind, q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, scale, max_segments, primitives):
    """One served kind: float32 (dq [b, tq, h, dqk], dk [b, tk, hkv, dqk], dv [b, tk, hkv, dv])."""
    batch, _, _, dqk = q.shape
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    meta = metadata(q_seg, kv_seg, max_segments)
    width = _width(dqk, dv, 0 if dlse is None else 2)
    qp, kp, vp = _operands(q, k, v, width)
    out, dout = _pad_last(out.astype(q.dtype), width), _pad_last(dout.astype(q.dtype), width)
    if dlse is not None:
        dlse = _where(meta.q_valid[..., None], dlse, 0)
        hi = dlse.astype(q.dtype)
        lo = (dlse.astype(jnp.float32) - hi.astype(jnp.float32)).astype(q.dtype)
        out = out.at[..., dv].set(-hi).at[..., dv + 1].set(-lo)
        dout = dout.at[..., dv : dv + 2].set(_full(dout, (), 1, dout.dtype))
    stats = stats_from_lse(lse, meta, batch * max_segments)
    unused = _unused(q.dtype)
    dq, dk, dv_ = primitives.backward(
        qp, kp, vp, unused, meta.q_seqlen, meta.kv_seqlen, meta.q_offsets, meta.kv_offsets, unused, unused,
        stats, out, dout, **_params(kind, scale),
    )  # fmt: skip

    group = _group(q, k)

    def grouped(x, d):
        """[b, tk, kv_heads x group, width] -> float32 [b, tk, kv_heads, d] summed over each group, zero outside
        segments."""
        x = x[..., :d].astype(jnp.float32).reshape(batch, tk, kv_heads, group, d).sum(3)
        return _where(meta.kv_valid[..., None, None], x, 0)

    dq = _where(meta.q_valid[..., None, None], dq[..., :dqk].astype(jnp.float32), 0)
    return dq, grouped(dk, dqk), grouped(dv_, dv)


def forward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, out_dtype=None, max_segments=MAX_SEGMENTS,
    slot_bytes=SLOT_BYTES, primitives=CUDNN, general=blockwise.forward,
):  # fmt: skip
    """parallel.kernels.blockwise.forward's arguments and results: (out [b, tq, h, dv] in `out_dtype` (default q's),
    lse [b, tq, h] float32). Raises Unservable for static indices cuDNN cannot mask (see call_kind); traced ones that
    turn out general, and rows with more segments than `slots` gives the call (from max_segments and slot_bytes),
    run `general` (a forward of the same signature: the blockwise kernel, or Pallas on GPU), as does every call
    with a sliding window (see the module docstring). The served kinds and the switch between them see the segment
    ids only; the indices stay as given (static or traced)."""
    if options.window is not None:
        return general(q, k, v, q_tokens, kv_tokens, options=options, out_dtype=out_dtype or q.dtype)
    max_segments = slots(q.shape, v.shape[-1], max_segments, slot_bytes)
    kind = call_kind(q_tokens.index, kv_tokens.index, options.causal)
    _check(q, v.shape[-1], primitives)
    served = functools.partial(_served_forward, scale=options.scale, max_segments=max_segments, primitives=primitives)

    def general_call(q, k, v, q_seg, kv_seg):
        """The general kernel on the same operands: (out [b, tq, h, dv], lse [b, tq, h])."""
        sides = (q_tokens._replace(segment_ids=q_seg), kv_tokens._replace(segment_ids=kv_seg))
        return general(q, k, v, *sides, options=options, out_dtype=q.dtype)

    by_kind = {DIAGONAL: functools.partial(served, DIAGONAL), ALL_VISIBLE: functools.partial(served, ALL_VISIBLE)}
    by_kind[GENERAL] = general_call
    q, *segment_ids = _tied(q, q_tokens.segment_ids, kv_tokens.segment_ids)
    out, lse = _switch(kind, q_tokens, kv_tokens, options.causal, max_segments, by_kind, q, k, v, *segment_ids)
    return out.astype(out_dtype or q.dtype), lse


def backward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, out, lse, dout, dlse, *, options: Options, grad_dtype=None,
    accumulate=None, max_segments=MAX_SEGMENTS, slot_bytes=SLOT_BYTES, primitives=CUDNN, general=blockwise.backward,
):  # fmt: skip
    """parallel.kernels.blockwise.backward's arguments and results: (dq, dk, dv) given the final out / lse and their
    cotangents (dlse may be None), in `grad_dtype` (default: q, k, v's dtypes), or added into `accumulate` sums in
    their dtypes. Raises Unservable as `forward` does; `general` as in `forward` (a backward), which takes every
    call with a sliding window."""
    if options.window is not None:
        args = (q, k, v, q_tokens, kv_tokens, out, lse, dout, dlse)
        return general(*args, options=options, grad_dtype=grad_dtype, accumulate=accumulate)
    max_segments = slots(q.shape, v.shape[-1], max_segments, slot_bytes)
    kind = call_kind(q_tokens.index, kv_tokens.index, options.causal)
    _check(q, v.shape[-1], primitives)
    served = functools.partial(_served_backward, scale=options.scale, max_segments=max_segments, primitives=primitives)

    def general_call(q, k, v, q_seg, kv_seg, out, lse, dout, dlse):
        """The general kernel on the same operands: float32 (dq, dk, dv)."""
        sides = (q_tokens._replace(segment_ids=q_seg), kv_tokens._replace(segment_ids=kv_seg))
        return general(q, k, v, *sides, out, lse, dout, dlse, options=options, grad_dtype=jnp.float32)

    def kind_of(kind):
        """The served backward of `kind` as a switch branch (operands as `general`'s)."""
        return lambda *a: served(kind, *a)

    by_kind = {DIAGONAL: kind_of(DIAGONAL), ALL_VISIBLE: kind_of(ALL_VISIBLE), GENERAL: general_call}
    q, *segment_ids = _tied(q, q_tokens.segment_ids, kv_tokens.segment_ids)
    operands = (q, k, v, *segment_ids, out, lse, dout, dlse)
    grads = _switch(kind, q_tokens, kv_tokens, options.causal, max_segments, by_kind, *operands)
    if accumulate is not None:
        return tuple((total + g).astype(total.dtype) for total, g in zip(accumulate, grads, strict=True))
    return tuple(g.astype(grad_dtype or x.dtype) for g, x in zip(grads, (q, k, v), strict=True))
