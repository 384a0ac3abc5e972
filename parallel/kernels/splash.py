"""JAX's Pallas TPU splash attention behind the kernel interface: the TPU's fused kernel, forward and backward.

It calls splash's forward and its two backward kernels (dq; dk and dv) directly, not the public `SplashAttentionKernel`,
whose VJP has no cotangent for the log-sum-exp that a ring's merge reads. Splash's backward takes a per-row `di`
(sum of dout . out); the lse's cotangent joins it as di - dlse (d lse / d score = p). The three functions keep one
signature in every JAX the project supports (0.10.2 to 0.12).

What splash gives and this module adapts:

- Masks: splash learns which blocks are empty, full or partial from a static mask before compiling (its MaskInfo),
  and masks partial blocks with stored [block_q, block_kv] blocks (each distinct one stored once). Here the mask is
  built from the call's global indices (`IndexMask`: causal, window), so every call kind the strategies make (a
  ring's diagonal and full steps, dual_chunk halves, striped, Ulysses') skips the blocks it cannot see. A call of
  traced query indices against keys in order (`Dynamic`: all_gather's, whose gathered keys are put in original
  order) gets its block table computed at run time and its mask computed in the kernel from the query indices
  (splash's `q_sequence`). Keys with traced indices are `Unservable` (the blockwise kernel takes the call). Segment
  ids are data: splash compares them in every block it runs.
- Padding: segment id 0 sees nothing. Splash matches ids by equality, so the keys' 0 becomes -1. Rows are padded to
  a multiple of the blocks (queries with id 0 and index -1, keys with id -1 and the largest index) and sliced back.
- Rows without a visible key: splash leaves them a finite or NaN output; they get zeros and lse -inf here, and the
  backward reads their lse as +inf (so p = 0 there).
- Layout and scale: splash takes [heads, t, d] without a batch (vmapped here) and unscaled logits, so q is scaled
  before (dq scaled after). GQA as is: splash reads each key head for its group of query heads.
- Blocks: the call's block_q / block_kv are rounded up to multiples of 128 (TPU lanes), at most MOST (VMEM) and cut
  to the padded row; the backward runs splash's separate dq kernel (its fused one keeps a dq copy per key block).
- MLA: splash takes a value width other than the query / key width (192 / 128).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as splash_info

from parallel.kernels import visible
from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.packed import Unservable, known_at_trace_time
from parallel.kernels.softmax import backward_delta
from parallel.rounding import round_up
from parallel.segments import INT32_MAX

LANES = 128  # a TPU vector register's lanes: splash's blocks are multiples of it
MOST = 512  # the largest block: the dk / dv kernel at 1024 x 1024 (GQA 32 / 8 x 128) needs 17 MiB of scoped VMEM, of 16
MASK_VALUE = splash_kernel.DEFAULT_MASK_VALUE
HEAD_DIM_MINOR = splash_kernel.QKVLayout.HEAD_DIM_MINOR
EMPTY = MASK_VALUE / 2  # an lse below this: the row saw no key


class IndexMask(splash_mask.Mask):
    """The static [tq, tk] mask of a call from its global indices: key j visible to query i when causal and
    kv_index[j] <= q_index[i] (and within the window), or always when not causal. Splash reads it block by block."""

    def __init__(self, q_index: np.ndarray, kv_index: np.ndarray, causal: bool, window: int | None):
        self.q_index, self.kv_index, self.causal, self.window = q_index, kv_index, causal, window
        self._key = (q_index.tobytes(), kv_index.tobytes(), causal, window)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q_index.size, self.kv_index.size)

    def __getitem__(self, idx) -> np.ndarray:
        rows, cols = idx
        q, kv = self.q_index[rows][:, None], self.kv_index[cols][None, :]
        if not self.causal:
            return np.ones((q.size, kv.size), bool)
        if kv.min() > q.max():  # a block no query sees
            return np.zeros((q.size, kv.size), bool)
        if self.window is None and kv.max() <= q.min():  # a block every query sees whole (most of a long row's)
            return np.ones((q.size, kv.size), bool)
        visible = kv <= q
        return visible if self.window is None else visible & (kv > q - self.window)

    def __eq__(self, other) -> bool:
        return isinstance(other, IndexMask) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


class Layout(NamedTuple):
    """A call's splash blocks, its padded lengths, and the MaskInfo (numpy) its forward and dq kernels read and the
    one its dk / dv kernel reads."""

    block_q: int
    block_kv: int
    tq: int
    tk: int
    forward: splash_info.MaskInfo
    dkv: splash_info.MaskInfo


def blocks(length: int, at_most: int) -> int:
    """A splash block for a side of `length` tokens, at most `at_most` (rounded up to 128) and MOST: a multiple of
    128."""
    return min(round_up(max(at_most, 1), LANES), MOST, round_up(length, LANES))


@functools.lru_cache(maxsize=64)
def layout(mask: IndexMask, heads: int, block_q: int, block_kv: int) -> Layout:
    """The splash Layout of `mask` (its sides multiples of the blocks) for `heads` query heads (cached: a model's
    layers share it)."""
    multi = splash_mask.MultiHeadMask([mask] * heads)
    shape = (block_q, block_kv)
    forward, _ = splash_info.process_mask(multi, shape, head_shards=1, q_seq_shards=1)
    dkv, _ = splash_info.process_mask_dkv(multi, shape, head_shards=1, q_seq_shards=1, shrink_grid=True)
    return Layout(block_q, block_kv, *mask.shape, forward, dkv)


class Dynamic(NamedTuple):
    """A call whose query indices are traced and whose keys are in order (kv_index = start + 0..tk-1): its blocks and
    padded lengths, the query indices counted from the keys' start (`q_sequence`, traced), and the call's causality
    and window. Splash computes such a mask in the kernel from q_sequence and each key's position."""

    block_q: int
    block_kv: int
    tq: int
    tk: int
    q_sequence: jax.Array
    causal: bool
    window: int | None

    def mask_function(self, q, kv):
        """[.., ..] query indices and key positions (int32) -> bool: visible."""
        if not self.causal:
            return kv >= 0
        visible = kv <= q
        return visible if self.window is None else visible & (kv > q - self.window)

    def infos(self) -> tuple[splash_info.MaskInfo, splash_info.MaskInfo]:
        """The (forward and dq, dk / dv) MaskInfo of the call, computed at run time: a block pair runs when some
        query of the block may see some key of the other (by the smallest and largest index of the query block)."""
        nq, nk = self.tq // self.block_q, self.tk // self.block_kv
        blocks_q = self.q_sequence.reshape(nq, self.block_q)
        first = jnp.arange(nk, dtype=jnp.int32) * self.block_kv
        if self.causal:
            runs = first[None, :] <= blocks_q.max(axis=1)[:, None]
            if self.window is not None:
                runs &= first[None, :] + self.block_kv - 1 > blocks_q.min(axis=1)[:, None] - self.window
        else:
            runs = jnp.ones((nq, nk), bool)
        block_mask = runs.astype(jnp.int32)[None]
        forward = splash_info.MaskInfo(_next_block(runs, axis=1)[None], None, block_mask, None, self.q_sequence)
        dkv = splash_info.MaskInfo(_next_block(runs, axis=0)[None], None, block_mask, None, self.q_sequence)
        return forward, dkv


def _next_block(runs, axis: int):
    """[nq, nk] bool -> int32 [nq, nk]: along `axis`, the index of the next block that runs (this one if it runs),
    or, past the last, the last that runs (0 if none): the block to fetch, so a skipped one costs no copy."""
    size = runs.shape[axis]
    position = lax.broadcasted_iota(jnp.int32, runs.shape, axis)
    upcoming = lax.cummin(jnp.where(runs, position, size), axis=axis, reverse=True)
    last = jnp.max(jnp.where(runs, position, 0), axis=axis, keepdims=True)
    return jnp.where(upcoming < size, upcoming, last)


def call_layout(q_tokens: Tokens, kv_tokens: Tokens, heads: int, options: Options) -> Layout | Dynamic | None:
    """The Layout of a call with static indices (None when no query sees any key), or the Dynamic call of traced
    query indices against keys in order (padded: queries -1, keys past the end); raises Unservable for any
    other."""
    q_index, kv_index = known_at_trace_time(q_tokens.index), known_at_trace_time(kv_tokens.index)
    if kv_index is None:
        raise Unservable("splash attention needs the keys' global indices known at trace time; these are traced")
    bq, bk = blocks(q_tokens.segment_ids.shape[1], options.block_q), blocks(kv_index.size, options.block_kv)
    tq, tk = round_up(q_tokens.segment_ids.shape[1], bq), round_up(kv_index.size, bk)
    if q_index is None:
        start = int(kv_index[0]) if kv_index.size else 0
        if not np.array_equal(kv_index, start + np.arange(kv_index.size)):
            raise Unservable("splash attention with traced query indices needs the keys in order; these are not")
        q_sequence = q_tokens.index.astype(jnp.int32) - start
        q_sequence = jnp.pad(q_sequence, (0, tq - q_sequence.shape[0]), constant_values=-1)
        return Dynamic(bq, bk, tq, tk, q_sequence, options.causal, options.window)
    if options.causal and not visible.share(Tokens(index=q_index), Tokens(index=kv_index), options):
        return None
    q_index = np.pad(q_index.astype(np.int32), (0, tq - q_index.size), constant_values=-1)
    kv_index = np.pad(kv_index.astype(np.int32), (0, tk - kv_index.size), constant_values=INT32_MAX)
    return layout(IndexMask(q_index, kv_index, options.causal, options.window), heads, bq, bk)


class Plan(NamedTuple):
    """What splash's kernels take for a call: its Layout or Dynamic (blocks, padded lengths), the MaskInfo of the
    forward and dq kernels and of the dk / dv kernel (arrays), and the mask function (None: stored blocks)."""

    lay: Layout | Dynamic
    forward: splash_info.MaskInfo
    dkv: splash_info.MaskInfo
    mask_function: object


def plan(q_tokens: Tokens, kv_tokens: Tokens, heads: int, options: Options) -> Plan | None:
    """The Plan of a call (see call_layout; None: no query sees any key)."""
    lay = call_layout(q_tokens, kv_tokens, heads, options)
    if lay is None:
        return None
    if isinstance(lay, Dynamic):
        return Plan(lay, *lay.infos(), lay.mask_function)
    return Plan(lay, jax.tree.map(jnp.asarray, lay.forward), jax.tree.map(jnp.asarray, lay.dkv), None)


def _block_sizes(lay: Layout | Dynamic) -> splash_kernel.BlockSizes:
    """Splash's blocks for every kernel of a call: one query and one key block, dq by its own kernel."""
    bq, bk = lay.block_q, lay.block_kv
    return splash_kernel.BlockSizes(
        block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk, block_kv_dkv_compute=bk,
        block_q_dq=bq, block_kv_dq=bk, use_fused_bwd_kernel=False,
    )  # fmt: skip


def _heads_first(x, length: int):
    """[batch, t, heads, d] -> [batch, heads, length, d], zero-padded."""
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0))).transpose(0, 2, 1, 3)


def _tokens_first(x, length: int):
    """[batch, heads, padded t, ...] -> [batch, length, heads, ...]."""
    return jnp.moveaxis(x[:, :, :length], 1, 2)


def _segments(q_tokens: Tokens, kv_tokens: Tokens, lay: Layout | Dynamic) -> splash_kernel.SegmentIds:
    """Each side's ids [batch, padded t] for splash: the keys' padding -1 (no query's id)."""
    q_seg, kv_seg = q_tokens.segment_ids, kv_tokens.segment_ids
    q_seg = jnp.pad(q_seg, ((0, 0), (0, lay.tq - q_seg.shape[1])))
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, lay.tk - kv_seg.shape[1])))
    return splash_kernel.SegmentIds(q=q_seg, kv=jnp.where(kv_seg == 0, -1, kv_seg))


def forward(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, out_dtype=None, interpret=False):
    """parallel.kernels.blockwise.forward's arguments and results: (out [batch, tq, heads, dv] in `out_dtype`
    (default q's), lse [batch, tq, heads] float32). Raises Unservable for a call call_layout refuses. `interpret`
    runs splash in Pallas' interpret mode (any backend)."""
    tq, heads = q.shape[1:3]
    call = plan(q_tokens, kv_tokens, heads, options)
    if call is None:
        return jnp.zeros((*q.shape[:3], v.shape[-1]), out_dtype or q.dtype), jnp.full(q.shape[:3], -jnp.inf)
    lay = call.lay
    run = functools.partial(
        splash_kernel._splash_attention_forward, call.forward, sinks=None, mask_value=MASK_VALUE, is_mqa=False,
        block_sizes=_block_sizes(lay), residual_checkpoint_name=None, save_residuals=True,
        mask_function=call.mask_function, interpret=interpret,
    )  # fmt: skip
    out, (lse,) = jax.vmap(run)(*_operands(q, k, v, q_tokens, kv_tokens, lay, options))
    seen = lse > EMPTY
    out = jnp.where(seen[..., None], out, 0).astype(out_dtype or q.dtype)
    return _tokens_first(out, tq), _tokens_first(jnp.where(seen, lse, -jnp.inf), tq)


def _operands(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, lay: Layout | Dynamic, options: Options):
    """(q, k, v [batch, heads, padded t, d], SegmentIds) as splash takes them: q times the call's scale (splash takes
    unscaled logits), in q's dtype."""
    scaled = (q.astype(jnp.float32) * options.scale).astype(q.dtype)
    padded = (_heads_first(scaled, lay.tq), _heads_first(k, lay.tk), _heads_first(v, lay.tk))
    return (*padded, _segments(q_tokens, kv_tokens, lay))


def backward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, out, lse, dout, dlse, *, options: Options, grad_dtype=None,
    accumulate=None, interpret=False, delta=None,
):  # fmt: skip
    """parallel.kernels.blockwise.backward's arguments and results: (dq, dk, dv) given the final out / lse and their
    cotangents (dlse may be None) or the rows' `delta`, in `grad_dtype` (default: q, k, v's dtypes), or added into
    `accumulate` sums in their dtypes. Raises Unservable as `forward` does."""
    tq, heads = q.shape[1:3]
    tk = k.shape[1]
    call = plan(q_tokens, kv_tokens, heads, options)
    if call is None:
        nothing = tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))
        return _gradients(nothing, (q, k, v), grad_dtype, accumulate)
    lay = call.lay
    rows = jnp.where(jnp.isfinite(lse), lse, jnp.inf)  # a row that saw no key: p = exp(score - inf) = 0
    rows = jnp.pad(rows, ((0, 0), (0, lay.tq - tq), (0, 0)), constant_values=jnp.inf).transpose(0, 2, 1)
    delta = backward_delta(out, dout, dlse) if delta is None else delta
    delta = jnp.pad(delta, ((0, 0), (0, lay.tq - tq), (0, 0))).transpose(0, 2, 1)
    shared = dict(
        bq=lay.block_q, bkv=lay.block_kv, is_mqa=False, mask_value=MASK_VALUE, attn_logits_soft_cap=None,
        mask_function=call.mask_function, interpret=interpret, q_layout=HEAD_DIM_MINOR, k_layout=HEAD_DIM_MINOR,
        v_layout=HEAD_DIM_MINOR,
    )  # fmt: skip

    def grads(q_, k_, v_, seg, rows_, dout_, delta_):
        """Splash's dq kernel, then its dk / dv kernel, on one row."""
        args = (q_, k_, v_, seg, None, rows_, dout_, delta_)
        dq = splash_kernel._splash_attention_bwd_dq(*args, mask_info=call.forward, **shared)
        _, dk, dv = splash_kernel._splash_attention_bwd_dkv(
            *args, bkv_compute=lay.block_kv, mask_info=call.dkv, use_fused_bwd_kernel=False, **shared
        )
        return dq, dk, dv

    operands = _operands(q, k, v, q_tokens, kv_tokens, lay, options)
    dq, dk, dv = jax.vmap(grads)(*operands, rows, _heads_first(dout, lay.tq), delta)
    found = (_tokens_first(dq.astype(jnp.float32) * options.scale, tq), _tokens_first(dk, tk), _tokens_first(dv, tk))
    return _gradients(found, (q, k, v), grad_dtype, accumulate)


def _gradients(found, inputs, grad_dtype, accumulate):
    """(dq, dk, dv) `found` in `grad_dtype` (default: the `inputs`' dtypes), or added into `accumulate`'s sums."""
    if accumulate is None:
        return tuple(g.astype(grad_dtype or x.dtype) for g, x in zip(found, inputs, strict=True))
    return tuple((s + g.astype(jnp.float32)).astype(s.dtype) for s, g in zip(accumulate, found, strict=True))
