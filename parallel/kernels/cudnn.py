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
- dlse: carried in two extra value columns (packed.with_dlse), only where something reads the lse.
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

from parallel import anchored, compat
from parallel.kernels import blockwise, packed
from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.packed import ALL_VISIBLE, DIAGONAL, Unservable  # noqa: F401 (cudnn.Unservable, as callers name it)

fa = compat.cudnn_attention()
MASKS = {DIAGONAL: fa.MaskType.PADDING_CAUSAL, ALL_VISIBLE: fa.MaskType.PADDING}
MAX_SEGMENTS = 64
SLOT_BYTES = 4 << 30  # cuDNN's per-slot buffers of one call (see slots)
UNUSED_SHAPE = (1,)  # the binds' unused bias / page-table operands: one element, never zero (module docstring)


class Primitives(NamedTuple):
    """forward / backward with the binds' signatures: fa._dot_product_attention_fwd_p_wrapper.bind (10 operands,
    then scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length, is_training) ->
    [out, stats]; the bwd wrapper's bind (the same 10, stats, out, dout; the same keywords less is_training) ->
    [dq, dk, dv]."""

    forward: object
    backward: object


CUDNN = Primitives(*compat.cudnn_binds())


def slots(q_shape, dv: int, max_segments: int = MAX_SEGMENTS, slot_bytes: int = SLOT_BYTES) -> int:
    """Segment slots of a call with queries of q_shape [batch, tq, heads, dqk] and value head dim dv: as many as keep
    cuDNN's float32 per-slot buffers (batch x slots x heads x tq x (padded width + 2)) within slot_bytes, at least 2
    (one slot is the primitive's unpacked layout, which ignores offsets) and at most max_segments."""
    batch, tq, heads, dqk = q_shape
    per_slot = batch * tq * heads * (packed.width(dqk, dv, 2) + 2) * 4
    return max(2, min(max_segments, slot_bytes // per_slot))


def lse_from_stats(stats, meta: packed.Metadata):
    """stats [batch * m, heads, tq] float32 -> lse [batch, tq, heads], -inf for tokens in no segment."""
    lse = stats[jnp.minimum(meta.q_row, stats.shape[0] - 1), :, meta.q_pos]
    return packed.where(meta.q_valid[..., None], lse, -jnp.inf)


def stats_from_lse(lse, meta: packed.Metadata, rows: int):
    """lse [batch, tq, heads] -> stats [rows, heads, tq] float32 (zeros where no token maps)."""
    stats = anchored.full(lse, (rows, lse.shape[2], lse.shape[1]), 0, jnp.float32)
    return stats.at[meta.q_row, :, meta.q_pos].set(lse.astype(jnp.float32), mode="drop")


def _group(q, k) -> int:
    """How many times K / V heads are repeated for the primitive: 1 where the binding takes GQA as it is (module
    docstring), else query heads / key heads."""
    return 1 if compat.cudnn_packed_gqa() else q.shape[2] // k.shape[2]


def _operands(q, k, v, width: int):
    """q [b, tq, h, dqk], k [b, tk, hkv, dqk], v [b, tk, hkv, dv] -> the three padded to `width`, k / v with their
    heads repeated `_group` times."""
    group = _group(q, k)
    return (
        packed.pad_last(q, width),
        packed.pad_last(jnp.repeat(k, group, axis=2), width),
        packed.pad_last(jnp.repeat(v, group, axis=2), width),
    )


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


def _check(q, dv: int, primitives: Primitives, dlse_columns: int):
    """q [b, tq, h, dqk], value head dim dv: raises Unservable for inputs the real primitives reject (not 16-bit, or
    a padded head width past 256, `dlse_columns` for the lse cotangent included: 2 in a backward given one, else 0);
    where a GPU is present, JAX's own flash-attention check of the padded operands."""
    if primitives is not CUDNN:
        return
    width = packed.check_width("cudnn", q, dv, dlse_columns)
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
    meta = packed.metadata(q_seg, kv_seg, max_segments)
    qp, kp, vp = _operands(q, k, v, packed.width(q.shape[-1], dv, 0))
    unused = _unused(q.dtype)
    out, stats = primitives.forward(
        qp, kp, vp, unused, meta.q_seqlen, meta.kv_seqlen, meta.q_offsets, meta.kv_offsets, unused, unused,
        **_params(kind, scale), is_training=True,
    )  # fmt: skip
    out = packed.where(meta.q_valid[..., None, None], out[..., :dv], 0).astype(q.dtype)
    return out, lse_from_stats(stats, meta)


def _served_backward(kind, q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, scale, max_segments, primitives):
    """One served kind: float32 (dq [b, tq, h, dqk], dk [b, tk, hkv, dqk], dv [b, tk, hkv, dv])."""
    batch, _, _, dqk = q.shape
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    meta = packed.metadata(q_seg, kv_seg, max_segments)
    width = packed.width(dqk, dv, 0 if dlse is None else 2)
    qp, kp, vp = _operands(q, k, v, width)
    out, dout = packed.with_dlse(out, dout, dlse, meta.q_valid, width, q.dtype)
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
        return packed.where(meta.kv_valid[..., None, None], x, 0)

    dq = packed.where(meta.q_valid[..., None, None], dq[..., :dqk].astype(jnp.float32), 0)
    return dq, grouped(dk, dqk), grouped(dv_, dv)


def forward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, out_dtype=None, max_segments=MAX_SEGMENTS,
    slot_bytes=SLOT_BYTES, primitives=CUDNN, general=blockwise.forward,
):  # fmt: skip
    """parallel.kernels.blockwise.forward's arguments and results: (out [b, tq, h, dv] in `out_dtype` (default q's),
    lse [b, tq, h] float32). Raises Unservable for static indices cuDNN cannot mask (see packed.call_kind); traced
    ones that turn out general, and rows with more segments than `slots` gives the call (from max_segments and
    slot_bytes), run `general` (a forward of the same signature: the blockwise kernel, or Pallas on GPU), as does
    every call with a sliding window (see the module docstring). The served kinds and the switch between them see the
    segment ids only; the indices stay as given (static or traced)."""
    if options.window is not None:
        return general(q, k, v, q_tokens, kv_tokens, options=options, out_dtype=out_dtype or q.dtype)
    max_segments = slots(q.shape, v.shape[-1], max_segments, slot_bytes)
    packed.call_kind(q_tokens.index, kv_tokens.index, options.causal)
    _check(q, v.shape[-1], primitives, 0)
    served = functools.partial(_served_forward, scale=options.scale, max_segments=max_segments, primitives=primitives)
    sides = dict(options=options, max_segments=max_segments, general=general)
    out, lse = packed.forward(served, q, k, v, q_tokens, kv_tokens, **sides)
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
    packed.call_kind(q_tokens.index, kv_tokens.index, options.causal)
    _check(q, v.shape[-1], primitives, 0 if dlse is None else 2)
    served = functools.partial(_served_backward, scale=options.scale, max_segments=max_segments, primitives=primitives)
    args = (q, k, v, q_tokens, kv_tokens, out, lse, dout, dlse)
    sides = dict(options=options, max_segments=max_segments, general=general)
    return packed.backward(served, *args, grad_dtype=grad_dtype, accumulate=accumulate, **sides)
