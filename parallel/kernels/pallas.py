"""Flash attention as Pallas kernels (Triton on GPU, interpret mode on CPU) with the blockwise kernel's semantics:
separate query and key segment ids, causality by global token index, block pairs that share no segment or lie
above the diagonal skipped (by the same block summaries, taken inside the kernel), GQA without repeating key /
value heads, query-key and value head dims that differ, lse out and its cotangent in.

Three kernels: the forward (grid batch x heads x query blocks, a loop over key blocks), dk / dv (grid batch x
key-value heads x key blocks, a loop over the group's query heads and query blocks) and dq (as the forward).
Head dims are zero-padded to a power of two and lengths to whole power-of-two blocks (Triton's block rule; zero
features change no dot product, padded tokens are segment 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from parallel.segments import INT32_MAX


def _pad_to(x, axis: int, size: int, value=0):
    """Pads `axis` of x with `value` up to `size`."""
    extra = size - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _blocks(length: int, block: int) -> tuple[int, int]:
    """(block size, padded length) for `length` tokens: a power of two (Triton's rule) of at most `block` (at least
    16, the smallest matrix-multiply tile) and no larger than needed."""
    size = max(16, min(1 << (block.bit_length() - 1), pl.next_power_of_2(length)))
    return size, -(-length // size) * size


def _summary(seg, index):
    """Segment-id and global-index range of one block: (smallest non-zero id, largest id, smallest, largest index)."""
    return jnp.min(jnp.where(seg > 0, seg, INT32_MAX)), jnp.max(seg), jnp.min(index), jnp.max(index)


def _visible(q_summary, kv_summary, causal: bool):
    """Whether any (query, key) pair of two blocks can be visible (parallel.segments.visible_blocks, one pair)."""
    q_lo, q_hi, _, q_index_hi = q_summary
    kv_lo, kv_hi, kv_index_lo, _ = kv_summary
    visible = (q_lo <= kv_hi) & (kv_lo <= q_hi)
    return visible & (kv_index_lo <= q_index_hi) if causal else visible


def _mask(q_seg, kv_seg, q_index, kv_index, causal: bool):
    """[bq] / [bk] ids and global indices -> [bq, bk] visibility."""
    mask = (q_seg[:, None] == kv_seg[None, :]) & (q_seg[:, None] > 0)
    return mask & (kv_index[None, :] <= q_index[:, None]) if causal else mask


def _dot(a, b, *, transpose_b: bool = False):
    """a [m, k] @ b [k, n] (or b [n, k] transposed) in float32."""
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _forward_kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, q_idx_ref, kv_idx_ref, out_ref, lse_ref, **static):
    causal, scale, bk, nk = static["causal"], static["scale"], static["block_kv"], static["kv_blocks"]
    q, q_seg, q_idx = q_ref[...], q_seg_ref[...], q_idx_ref[...]
    q_summary = _summary(q_seg, q_idx)

    def update(window, kv_seg, kv_idx, carry):
        row_max, row_sum, acc = carry
        s = _dot(q, k_ref[window, :], transpose_b=True) * scale
        s = jnp.where(_mask(q_seg, kv_seg, q_idx, kv_idx, causal), s, -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        p = jnp.exp(s - safe_max[:, None])
        correction = jnp.exp(row_max - safe_max)
        pv = _dot(p.astype(v_ref.dtype), v_ref[window, :])
        return new_max, row_sum * correction + p.sum(-1), acc * correction[:, None] + pv

    def step(j, carry):
        window = pl.ds(j * bk, bk)
        kv_seg, kv_idx = kv_seg_ref[window], kv_idx_ref[window]
        visible = _visible(q_summary, _summary(kv_seg, kv_idx), causal)
        return lax.cond(visible, functools.partial(update, window, kv_seg, kv_idx), lambda c: c, carry)

    bq = q.shape[0]
    init = (
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),
    )
    row_max, row_sum, acc = lax.fori_loop(0, nk, step, init)
    seen = row_sum > 0
    out_ref[...] = (acc / jnp.where(seen, row_sum, 1.0)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)


def _prepare(q, k, v, q_seg, kv_seg, q_index, kv_index, block_q, block_kv):
    """Pads lengths to whole blocks (padding: segment 0) and head dims to powers of two; returns the padded
    arrays and (bq, bk)."""
    bq, tq = _blocks(q.shape[1], block_q)
    bk, tk = _blocks(k.shape[1], block_kv)
    dqk, dv = pl.next_power_of_2(q.shape[-1]), pl.next_power_of_2(v.shape[-1])
    q = _pad_to(_pad_to(q, 1, tq), 3, dqk)
    k = _pad_to(_pad_to(k, 1, tk), 3, dqk)
    v = _pad_to(_pad_to(v, 1, tk), 3, dv)
    q_seg, q_index = _pad_to(q_seg, 1, tq), _pad_to(q_index, 0, tq)
    kv_seg, kv_index = _pad_to(kv_seg, 1, tk), _pad_to(kv_index, 0, tk, INT32_MAX)  # padded keys skip causally
    return (q, k, v, q_seg, kv_seg, q_index, kv_index), (bq, bk)


def forward(
    q, k, v, q_seg, kv_seg, q_index, kv_index, *, causal, scale, block_q, block_kv, interpret=False, out_dtype=None
):
    """parallel.blockwise.forward's arguments and results, as a Pallas kernel: (out [batch, tq, heads, dv] in
    `out_dtype` (default q's), lse [batch, tq, heads] float32)."""
    batch, tq, heads, _ = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    group = heads // kv_heads
    (q, k, v, q_seg, kv_seg, q_index, kv_index), (bq, bk) = _prepare(
        q, k, v, q_seg, kv_seg, q_index, kv_index, block_q, block_kv
    )
    tq_pad, tk_pad, dqk_pad, dv_pad = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    kernel = functools.partial(_forward_kernel, causal=causal, scale=scale, block_kv=bk, kv_blocks=tk_pad // bk)
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, heads, tq_pad // bq),
        in_specs=[
            pl.BlockSpec((None, bq, None, dqk_pad), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, tk_pad, None, dqk_pad), lambda b, h, i: (b, 0, h // group, 0)),
            pl.BlockSpec((None, tk_pad, None, dv_pad), lambda b, h, i: (b, 0, h // group, 0)),
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, tk_pad), lambda b, h, i: (b, 0)),
            pl.BlockSpec((bq,), lambda b, h, i: (i,)),
            pl.BlockSpec((tk_pad,), lambda b, h, i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, dv_pad), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, tq_pad, heads, dv_pad), out_dtype or q.dtype),
            jax.ShapeDtypeStruct((batch, heads, tq_pad), jnp.float32),
        ],
        interpret=interpret,
        name="attention_forward",
    )(q, k, v, q_seg, kv_seg, q_index, kv_index)
    return out[:, :tq, :, :dv], jnp.swapaxes(lse, 1, 2)[:, :tq]


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, q_idx_ref, kv_idx_ref, dk_ref, dv_ref,
    **static,
):  # fmt: skip
    causal, scale, bq, nq, group = (static[key] for key in ("causal", "scale", "block_q", "q_blocks", "group"))
    k, v, kv_seg, kv_idx = k_ref[...], v_ref[...], kv_seg_ref[...], kv_idx_ref[...]
    kv_summary = _summary(kv_seg, kv_idx)

    def update(window, q_seg, q_idx, head, carry):
        dk, dv = carry
        q, do = q_ref[window, head, :], do_ref[window, head, :]
        lse, delta = lse_ref[head, window], delta_ref[head, window]
        s = _dot(q, k, transpose_b=True) * scale
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        p = jnp.where(_mask(q_seg, kv_seg, q_idx, kv_idx, causal), jnp.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, v, transpose_b=True)
        ds = (p * (dp - delta[:, None])).astype(q.dtype)
        dv = dv + _dot(p.astype(do.dtype).T, do)
        dk = dk + _dot(ds.T, q) * scale
        return dk, dv

    def step(i, carry):
        window = pl.ds(i * bq, bq)
        q_seg, q_idx = q_seg_ref[window], q_idx_ref[window]
        visible = _visible(_summary(q_seg, q_idx), kv_summary, causal)
        for head in range(group):  # the query heads that share this key-value head
            carry = lax.cond(visible, functools.partial(update, window, q_seg, q_idx, head), lambda c: c, carry)
        return carry

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, nq, step, init)
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_seg_ref, kv_seg_ref, q_idx_ref, kv_idx_ref, dq_ref, **static
):
    causal, scale, bk, nk = static["causal"], static["scale"], static["block_kv"], static["kv_blocks"]
    q, do, q_seg, q_idx = q_ref[...], do_ref[...], q_seg_ref[...], q_idx_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    q_summary = _summary(q_seg, q_idx)

    def update(window, kv_seg, kv_idx, dq):
        k, v = k_ref[window, :], v_ref[window, :]
        s = _dot(q, k, transpose_b=True) * scale
        p = jnp.where(_mask(q_seg, kv_seg, q_idx, kv_idx, causal), jnp.exp(s - lse[:, None]), 0.0)
        ds = (p * (_dot(do, v, transpose_b=True) - delta[:, None])).astype(k.dtype)
        return dq + _dot(ds, k) * scale

    def step(j, dq):
        window = pl.ds(j * bk, bk)
        kv_seg, kv_idx = kv_seg_ref[window], kv_idx_ref[window]
        visible = _visible(q_summary, _summary(kv_seg, kv_idx), causal)
        return lax.cond(visible, functools.partial(update, window, kv_seg, kv_idx), lambda c: c, dq)

    dq = lax.fori_loop(0, nk, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def backward(
    q,
    k,
    v,
    q_seg,
    kv_seg,
    q_index,
    kv_index,
    out,
    lse,
    dout,
    dlse,
    *,
    causal,
    scale,
    block_q,
    block_kv,
    interpret=False,
    grad_dtype=None,
    accumulate=None,
):
    """parallel.blockwise.backward's arguments and results, as Pallas kernels: (dq, dk, dv) of `forward` given its
    final out / lse and their cotangents (dlse may be None), in `grad_dtype` (default: the dtypes of q, k, v); or,
    given `accumulate` = (dq, dk, dv) running sums, those sums with them added, in their dtypes."""
    if accumulate is not None:
        args = (q, k, v, q_seg, kv_seg, q_index, kv_index, out, lse, dout, dlse)
        static = dict(causal=causal, scale=scale, block_q=block_q, block_kv=block_kv, interpret=interpret)
        grads = backward(*args, **static, grad_dtype=jnp.float32)
        return tuple((total + g).astype(total.dtype) for total, g in zip(accumulate, grads, strict=True))
    batch, tq, heads, dqk = q.shape
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    # d score = p (dp - delta), delta = dout . out - dlse (see parallel.blockwise.backward)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    if dlse is not None:
        delta = delta - dlse
    dtypes = (q.dtype, k.dtype, v.dtype)
    (q, k, v, q_seg, kv_seg, q_index, kv_index), (bq, bk) = _prepare(
        q, k, v, q_seg, kv_seg, q_index, kv_index, block_q, block_kv
    )
    tq_pad, tk_pad, dqk_pad, dv_pad = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    dout = _pad_to(_pad_to(dout, 1, tq_pad), 3, dv_pad)
    lse = jnp.swapaxes(_pad_to(lse, 1, tq_pad, -jnp.inf), 1, 2)  # [batch, heads, tq]
    delta = jnp.swapaxes(_pad_to(delta, 1, tq_pad), 1, 2)
    operands = (q, k, v, dout, lse, delta, q_seg, kv_seg, q_index, kv_index)
    dk, dv_ = pl.pallas_call(
        functools.partial(_dkdv_kernel, causal=causal, scale=scale, block_q=bq, q_blocks=tq_pad // bq, group=group),
        grid=(batch, kv_heads, tk_pad // bk),
        in_specs=[
            pl.BlockSpec((None, tq_pad, group, dqk_pad), lambda b, g, j: (b, 0, g, 0)),
            pl.BlockSpec((None, bk, None, dqk_pad), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, bk, None, dv_pad), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, tq_pad, group, dv_pad), lambda b, g, j: (b, 0, g, 0)),
            pl.BlockSpec((None, group, tq_pad), lambda b, g, j: (b, g, 0)),
            pl.BlockSpec((None, group, tq_pad), lambda b, g, j: (b, g, 0)),
            pl.BlockSpec((None, tq_pad), lambda b, g, j: (b, 0)),
            pl.BlockSpec((None, bk), lambda b, g, j: (b, j)),
            pl.BlockSpec((tq_pad,), lambda b, g, j: (0,)),
            pl.BlockSpec((bk,), lambda b, g, j: (j,)),
        ],
        out_specs=[
            pl.BlockSpec((None, bk, None, dqk_pad), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, bk, None, dv_pad), lambda b, g, j: (b, j, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, grad_dtype or dtypes[1]),
            jax.ShapeDtypeStruct(v.shape, grad_dtype or dtypes[2]),
        ],
        interpret=interpret,
        name="attention_dkdv",
    )(*operands)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, causal=causal, scale=scale, block_kv=bk, kv_blocks=tk_pad // bk),
        grid=(batch, heads, tq_pad // bq),
        in_specs=[
            pl.BlockSpec((None, bq, None, dqk_pad), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, tk_pad, None, dqk_pad), lambda b, h, i: (b, 0, h // group, 0)),
            pl.BlockSpec((None, tk_pad, None, dv_pad), lambda b, h, i: (b, 0, h // group, 0)),
            pl.BlockSpec((None, bq, None, dv_pad), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, tk_pad), lambda b, h, i: (b, 0)),
            pl.BlockSpec((bq,), lambda b, h, i: (i,)),
            pl.BlockSpec((tk_pad,), lambda b, h, i: (0,)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, dqk_pad), lambda b, h, i: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, grad_dtype or dtypes[0]),
        interpret=interpret,
        name="attention_dq",
    )(*operands)
    return dq[:, :tq, :, :dqk], dk[:, :tk, :, :dqk], dv_[:, :tk, :, :dv]
