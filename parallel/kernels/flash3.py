"""FlashAttention-3 (Hopper's kernels: sm90a, bfloat16 / float16, heads up to 256 wide) on packed rows, behind the
kernel interface.

The binding: the `dew-flash-attn-cu12` / `-cu13` wheels (BSD-3; the extras flash3-cuda12 / flash3-cuda13, JAX 0.11.2
on) ship FlashAttention-3's variable-length forward and backward as XLA FFI targets in a library with no Python ABI,
libdew_flash_attn3.so. This module loads that library itself, without importing the wheel's package (which loads a
340 MB FlashAttention-2 library too and whose functions return no lse), registers the two targets and calls them:

- forward(q [T, h, d], k [Tk, hk, d], v [Tk, hk, d], cu_q [n + 1], cu_k [n + 1]) -> out [T, h, d], lse [h, T]
  float32 (natural log), and two one-element scratch results; attributes max_seqlen, max_seqlen_k, softmax_scale,
  is_causal, window_size_left / _right.
- backward(dout, q, k, v, out, lse, cu_q, cu_k; the same attributes) -> dq, dk [Tk, hk, d], dv, and two float32
  scratch buffers of h x (T + 128 (n + 1)) (the backward's per-row statistics, a block of rows more a sequence).

Sequence i holds queries cu_q[i]..cu_q[i + 1] and keys cu_k[i]..cu_k[i + 1]; causality is each sequence's own,
aligned to its last key (on the DIAGONAL the two sides of a sequence are one run, so it is the document's causal
mask). What the adaptation adds (the kinds, slots and run-time switch are parallel/kernels/packed.py's):

- Gaps: a row of m slots is 2m + 1 sequences, the gap before each slot's run (tokens in no served slot: padding,
  ids a slot leaves out), the run, and the gap after the last; rows follow each other (q and k flattened over the
  batch). Gaps pair with gaps and come back zero (lse -inf, no gradient), so no token moves and one call serves the
  batch. The runs must lie in slot order along the row (segment ids increasing along it, as packing numbers
  documents); a row where they do not runs the general kernel (a run-time branch).
- Widths: Q, K and V zero-padded to one width, a multiple of 8 (the kernels read V with K's strides and round the
  width up to 64, 128, 192 or 256 themselves); MLA's V of 128 goes padded to 192.
- GQA: native; dK / dV come back per key head.
- dlse: two extra value columns (packed.with_dlse), only where something reads the lse.
- The lse handed to the backward is +inf on gap queries, so their weights exp(s - lse) are 0 and the gaps stay
  finite.
- Windows: the kernel's window counts positions within a sequence, so it is the global window on a DIAGONAL call of
  consecutive indices (a document on one device, a contiguous piece); every other windowed call runs the general
  kernel.
- FLOPs: the calls run in the scope `packed_rows_<batch>`, which train/planning/speed.py reads to cost a flattened call
  as `batch` rows (its operands show one).

`Library` holds the two calls; tests pass a dense stand-in with the same signature (tests/parallel/flash3_standin.py).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel.kernels import blockwise, packed
from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.packed import DIAGONAL, Unservable

PACKAGE, LIBRARY = "dew_flash_attn", "libdew_flash_attn3.so"
TARGETS = ("dew_flash3_mha_varlen_fwd", "dew_flash3_mha_varlen_bwd")
MAX_SEGMENTS = 64  # slots a row: the kernel keeps no per-slot buffers, so this bounds only the documents a row served
ROWS = "packed_rows_{rows}"
SCRATCH_BLOCK = 128  # the backward's row block, the most its width and mask choose


class Library(NamedTuple):
    """forward(q, k, v, cu_q, cu_k, *, lengths, scale, causal, window) -> (out [T, h, d], lse [h, T] float32);
    backward(dout, q, k, v, out, lse, cu_q, cu_k, *, the same) -> (dq, dk, dv). lengths: (longest query run,
    longest key run); window: (left, right), -1 unbounded."""

    forward: object
    backward: object


def missing() -> str | None:
    """Why FlashAttention-3 cannot be called here (its wheel not installed), or None."""
    if importlib.util.find_spec(PACKAGE) is None:
        return (
            "attention kernel 'flash3' needs FlashAttention-3's binding: pip install '.[flash3-cuda13]' (or "
            "flash3-cuda12 for JAX's CUDA 12 plugin; JAX 0.11.2 or newer)"
        )
    return None


@functools.cache
def _registered() -> None:
    """The library's two FFI targets registered with JAX (once, at the first call that lowers one)."""
    problem = missing()
    if problem:
        raise ValueError(problem)
    folder = pathlib.Path(importlib.util.find_spec(PACKAGE).submodule_search_locations[0])
    try:
        library = ctypes.CDLL(str(folder / LIBRARY))
    except OSError:  # installed apart from JAX's CUDA libraries (pip --target): its runpath misses libcudart
        for runtime in _cuda_runtimes():
            ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)
        library = ctypes.CDLL(str(folder / LIBRARY))
    for target in TARGETS:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="CUDA")


def _cuda_runtimes() -> list[pathlib.Path]:
    """The CUDA runtime libraries (libcudart.so.N) of the NVIDIA packages JAX's CUDA plugin installed."""
    spec = importlib.util.find_spec("nvidia")
    folders = [pathlib.Path(f) for f in (spec.submodule_search_locations or [])] if spec else []
    return [path for folder in folders for path in sorted(folder.glob("*/lib/libcudart.so.*"))]


def _attributes(lengths, scale: float, causal: bool, window) -> dict:
    return dict(
        max_seqlen=np.int64(lengths[0]),
        max_seqlen_k=np.int64(lengths[1]),
        softmax_scale=np.float64(scale),
        is_causal=bool(causal),
        window_size_left=np.int64(window[0]),
        window_size_right=np.int64(window[1]),
    )


def _forward(q, k, v, cu_q, cu_k, *, lengths, scale, causal, window):
    _registered()
    results = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((q.shape[1], q.shape[0]), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1), jnp.float32),
    )
    call = jax.ffi.ffi_call(TARGETS[0], results)
    out, lse, _, _ = call(q, k, v, cu_q, cu_k, **_attributes(lengths, scale, causal, window))
    return out, lse


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, *, lengths, scale, causal, window):
    _registered()
    sequences = cu_q.shape[0] - 1
    scratch = jax.ShapeDtypeStruct((q.shape[1] * (q.shape[0] + SCRATCH_BLOCK * (sequences + 1)),), jnp.float32)
    results = (*(jax.ShapeDtypeStruct(x.shape, q.dtype) for x in (q, k, v)), scratch, scratch)
    call = jax.ffi.ffi_call(TARGETS[1], results)
    dq, dk, dv, _, _ = call(dout, q, k, v, out, lse, cu_q, cu_k, **_attributes(lengths, scale, causal, window))
    return dq, dk, dv


FLASH3 = Library(_forward, _backward)


def _runs(seqlen, offsets):
    """A side's slots (seqlen [batch, m], offsets [batch, m + 1] as packed.metadata gives them, -1 where empty) ->
    (filled, start, before) [batch, m]: whether each slot holds a run, where it starts, and where the runs of the
    slots before it reach at the furthest (0 for the first)."""
    filled, start = seqlen > 0, offsets[:, :-1]
    reach = lax.cummax(jnp.where(filled, start + seqlen, 0), axis=1)
    before = jnp.concatenate([jnp.zeros_like(reach[:, :1]), reach[:, :-1]], axis=1)
    return filled, start, before


def sequences(seqlen, offsets, length: int):
    """A side's slots (as _runs takes them) -> cu_seqlens [batch (2m + 1) + 1] int32 over the side's flattened rows
    of `length`: each slot's run with the gap before it, and the row's last gap (an empty slot is a run of none
    where the previous one ended)."""
    batch = seqlen.shape[0]
    filled, start, before = _runs(seqlen, offsets)
    start = jnp.where(filled, start, before)
    stop = jnp.where(filled, start + seqlen, before)
    bounds = jnp.stack([start, stop], axis=2).reshape(batch, -1)
    row = (jnp.arange(batch, dtype=jnp.int32) * length)[:, None]
    bounds = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), bounds], axis=1) + row
    return jnp.concatenate([bounds.reshape(-1), jnp.full((1,), batch * length, jnp.int32)]).astype(jnp.int32)


def out_of_order(seqlen, offsets):
    """[batch, m] slots of a side -> bool: some row's filled slots do not follow each other along it."""
    filled, start, before = _runs(seqlen, offsets)
    return jnp.any(filled & (start < before))


def _unserved(max_segments: int):
    """packed.switch's `unserved` for these calls: rows whose runs are out of slot order on either side."""

    def unserved(q_seg, kv_seg):
        meta = packed.metadata(q_seg, kv_seg, max_segments)
        q_side = out_of_order(meta.q_seqlen, meta.q_offsets)
        return q_side | out_of_order(meta.kv_seqlen, meta.kv_offsets)

    return unserved


def _flat(x, width: int):
    """[b, t, heads, d] -> [b t, heads, width] zero-padded."""
    return packed.pad_last(x, width).reshape(-1, *x.shape[2:-1], width)


def _call(kind, q_seg, kv_seg, options: Options, max_segments: int) -> tuple[packed.Metadata, tuple, dict]:
    """The call's metadata, (cu_q, cu_k), and the library's keyword arguments."""
    meta = packed.metadata(q_seg, kv_seg, max_segments)
    cu = (sequences(meta.q_seqlen, meta.q_offsets, q_seg.shape[1]),)
    cu += (sequences(meta.kv_seqlen, meta.kv_offsets, kv_seg.shape[1]),)
    window = (-1, -1) if options.window is None else (options.window - 1, 0)
    lengths = (q_seg.shape[1], kv_seg.shape[1])
    return meta, cu, dict(lengths=lengths, scale=options.scale, causal=kind == DIAGONAL, window=window)


def _served_forward(kind, q, k, v, q_seg, kv_seg, *, options: Options, max_segments: int, library: Library):
    """One served kind: (out [b, tq, h, dv] in q's dtype, lse [b, tq, h] float32)."""
    batch, tq, heads, dqk = q.shape
    dv = v.shape[-1]
    meta, cu, call = _call(kind, q_seg, kv_seg, options, max_segments)
    width = packed.width(dqk, dv, 0)
    with jax.named_scope(ROWS.format(rows=batch)):
        out, lse = library.forward(_flat(q, width), _flat(k, width), _flat(v, width), *cu, **call)
    out = out.reshape(batch, tq, heads, width)[..., :dv]
    lse = lse.T.reshape(batch, tq, heads)
    return packed.where(meta.q_valid[..., None, None], out, 0), packed.where(meta.q_valid[..., None], lse, -jnp.inf)


def _served_backward(
    kind, q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, options: Options, max_segments: int, library: Library
):  # fmt: skip
    """One served kind: float32 (dq [b, tq, h, dqk], dk [b, tk, hkv, dqk], dv [b, tk, hkv, dv])."""
    batch, _, heads, dqk = q.shape
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    meta, cu, call = _call(kind, q_seg, kv_seg, options, max_segments)
    width = packed.width(dqk, dv, 0 if dlse is None else 2)
    out, dout = packed.with_dlse(out, dout, dlse, meta.q_valid, width, q.dtype)
    lse = packed.where(meta.q_valid[..., None], lse.astype(jnp.float32), jnp.inf).reshape(-1, heads).T
    flat = [_flat(x, width) for x in (dout, q, k, v, out)]
    with jax.named_scope(ROWS.format(rows=batch)):
        dq, dk, dv_ = library.backward(*flat[:4], flat[4], lse, *cu, **call)

    def side(x, valid, shape):
        """[b t, heads, width] -> float32 [b, t, heads, d] sliced, zero outside served slots."""
        x = x.reshape(*shape[:3], width)[..., : shape[3]].astype(jnp.float32)
        return packed.where(valid[..., None, None], x, 0)

    grads = (side(dq, meta.q_valid, q.shape), side(dk, meta.kv_valid, k.shape))
    return (*grads, side(dv_, meta.kv_valid, (batch, tk, kv_heads, dv)))


def _check(q, v, q_tokens: Tokens, kv_tokens: Tokens, options: Options, library: Library, dlse_columns: int):
    """Raises Unservable for inputs the kernels do not take (not 16-bit, a padded width past 256 with `dlse_columns`
    for the lse cotangent: 2 in a backward given one, else 0; a stand-in takes any dtype) and for a window the
    kernel cannot place (not a DIAGONAL call of static consecutive indices)."""
    packed.check_width("flash3", q, v.shape[-1], dlse_columns, any_dtype=library is not FLASH3)
    if options.window is not None:
        q_index, kv_index = (packed.known_at_trace_time(side.index) for side in (q_tokens, kv_tokens))
        diagonal = q_index is not None and kv_index is not None and np.array_equal(q_index, kv_index)
        if not (diagonal and np.all(np.diff(q_index) == 1)):
            raise Unservable("attention kernel 'flash3' places a window only on a diagonal of consecutive indices")


def forward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, out_dtype=None, max_segments=MAX_SEGMENTS,
    library=FLASH3, general=blockwise.forward,
):  # fmt: skip
    """parallel.kernels.blockwise.forward's arguments and results: (out [b, tq, h, dv] in `out_dtype` (default q's),
    lse [b, tq, h] float32). Raises Unservable for calls it cannot serve statically (see _check and
    packed.call_kind); rows it cannot serve at run time run `general` (a forward of the same signature)."""
    packed.call_kind(q_tokens.index, kv_tokens.index, options.causal)
    _check(q, v, q_tokens, kv_tokens, options, library, 0)
    served = functools.partial(_served_forward, options=options, max_segments=max_segments, library=library)
    sides = dict(options=options, max_segments=max_segments, general=general, unserved=_unserved(max_segments))
    out, lse = packed.forward(served, q, k, v, q_tokens, kv_tokens, **sides)
    return out.astype(out_dtype or q.dtype), lse


def backward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, out, lse, dout, dlse, *, options: Options, grad_dtype=None,
    accumulate=None, max_segments=MAX_SEGMENTS, library=FLASH3, general=blockwise.backward,
):  # fmt: skip
    """parallel.kernels.blockwise.backward's arguments and results: (dq, dk, dv) given the final out / lse and their
    cotangents (dlse may be None), in `grad_dtype` (default q, k, v's dtypes), or added into `accumulate` sums in
    their dtypes. Raises Unservable as `forward` does; `general` a backward."""
    packed.call_kind(q_tokens.index, kv_tokens.index, options.causal)
    _check(q, v, q_tokens, kv_tokens, options, library, 0 if dlse is None else 2)
    served = functools.partial(_served_backward, options=options, max_segments=max_segments, library=library)
    sides = dict(options=options, max_segments=max_segments, general=general, unserved=_unserved(max_segments))
    args = (q, k, v, q_tokens, kv_tokens, out, lse, dout, dlse)
    return packed.backward(served, *args, grad_dtype=grad_dtype, accumulate=accumulate, **sides)
