"""Blockwise (flash-style) attention in plain JAX, forward and backward: online softmax over key blocks,
recomputation in the backward pass, and block pairs that share no segment or lie above the causal diagonal skipped
entirely. The CPU kernel and the reference for the others; `parallel.kernels.attention` makes it differentiable.

Causality compares GLOBAL token indices (`q_index`, `kv_index`), so the pieces a device holds may be
non-contiguous (load-balanced layouts) and come from different devices (ring steps).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from parallel.segments import block_summary, visible_blocks


def _pad(x, axis: int, multiple: int, value=0):
    """Pads `axis` of x up to a multiple of `multiple` with `value`."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _padded_blocks(length: int, block: int) -> tuple[int, int]:
    """(block size, number of blocks) for a sequence of `length` with at most `block` tokens per block."""
    size = min(block, length)
    return size, -(-length // size)


def _block_ranges(visible):
    """visible: [batch, n, m] bool -> (first, one past last) visible column per row, [batch, n] int32 (0, 0 if none)."""
    m = visible.shape[-1]
    any_visible = visible.any(-1)
    first = jnp.argmax(visible, axis=-1)
    last = m - jnp.argmax(visible[..., ::-1], axis=-1)
    return jnp.where(any_visible, first, 0).astype(jnp.int32), jnp.where(any_visible, last, 0).astype(jnp.int32)


def _block_mask(q_seg, kv_seg, q_index, kv_index, causal: bool):
    """[bq] / [bk] segment ids and global indices of one block pair -> [bq, 1, 1, bk] visibility."""
    mask = (q_seg[:, None] == kv_seg[None, :]) & (q_seg[:, None] > 0)
    if causal:
        mask &= kv_index[None, :] <= q_index[:, None]
    return mask[:, None, None, :]


def _take_block(x, b, i, size):
    """Rows [i*size, (i+1)*size) of batch row b of x: [batch, t, ...] -> [size, ...]."""
    start = (b, i * size) + (0,) * (x.ndim - 2)
    return lax.dynamic_slice(x, start, (1, size, *x.shape[2:]))[0]


def _scores(q_blk, k_blk, scale):
    """q_blk [bq, kv_heads, group, d], k_blk [bk, kv_heads, d] -> float32 [bq, kv_heads, group, bk]."""
    return jnp.einsum("qhgd,khd->qhgk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def forward(q, k, v, q_seg, kv_seg, q_index, kv_index, *, causal, scale, block_q, block_kv, out_dtype=None):
    """Forward pass without the custom VJP (strategies call it directly); same arguments as `attention`,
    all given. Returns (out [batch, tq, heads, dv] in `out_dtype` (default q's), lse [batch, tq, heads] float32)."""
    batch, tq, heads, dqk = q.shape
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    bq, nq = _padded_blocks(tq, block_q)
    bk, _ = _padded_blocks(tk, block_kv)
    q, q_seg, q_index = _pad(q, 1, bq), _pad(q_seg, 1, bq), _pad(q_index, 0, bq)
    k, v, kv_seg, kv_index = _pad(k, 1, bk), _pad(v, 1, bk), _pad(kv_seg, 1, bk), _pad(kv_index, 0, bk)
    visible = visible_blocks(block_summary(q_seg, q_index, bq), block_summary(kv_seg, kv_index, bk), causal=causal)
    first, last = _block_ranges(visible)

    def q_block(flat):
        b, i = flat // nq, flat % nq
        q_blk = _take_block(q, b, i, bq).reshape(bq, kv_heads, group, dqk)
        q_seg_blk, q_idx_blk = _take_block(q_seg, b, i, bq), lax.dynamic_slice_in_dim(q_index, i * bq, bq)

        def update(j, carry):
            row_max, row_sum, acc = carry
            k_blk, v_blk = _take_block(k, b, j, bk), _take_block(v, b, j, bk)
            mask = _block_mask(
                q_seg_blk,
                _take_block(kv_seg, b, j, bk),
                q_idx_blk,
                lax.dynamic_slice_in_dim(kv_index, j * bk, bk),
                causal,
            )
            s = jnp.where(mask, _scores(q_blk, k_blk, scale), -jnp.inf)
            new_max = jnp.maximum(row_max, s.max(-1))
            safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            p = jnp.exp(s - safe_max[..., None])
            correction = jnp.exp(row_max - safe_max)
            pv = jnp.einsum("qhgk,khd->qhgd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return new_max, row_sum * correction + p.sum(-1), acc * correction[..., None] + pv

        def step(j, carry):
            return lax.cond(visible[b, i, j], functools.partial(update, j), lambda c: c, carry)

        init = (
            jnp.full((bq, kv_heads, group), -jnp.inf, jnp.float32),
            jnp.zeros((bq, kv_heads, group), jnp.float32),
            jnp.zeros((bq, kv_heads, group, dv), jnp.float32),
        )
        row_max, row_sum, acc = lax.fori_loop(first[b, i], last[b, i], step, init)
        seen = row_sum > 0
        out = acc / jnp.where(seen, row_sum, 1.0)[..., None]
        lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
        return out.reshape(bq, heads, dv).astype(out_dtype or q.dtype), lse.reshape(bq, heads)

    out, lse = lax.map(q_block, jnp.arange(batch * nq))
    return out.reshape(batch, nq * bq, heads, dv)[:, :tq], lse.reshape(batch, nq * bq, heads)[:, :tq]


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
    grad_dtype=None,
):
    """Gradients (dq, dk, dv) of `forward` given its final out / lse and their cotangents (dlse may be None),
    in `grad_dtype` (default: the dtypes of q, k, v).

    One pass over key blocks; for each, the visible query blocks update dk/dv locally and dq in place.
    """
    batch, tq, heads, dqk = q.shape
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    # d score_ij = p_ij (dp_ij - delta_i) with delta_i = sum_j p_ij dp_ij = dout_i . out_i. When lse is an output
    # too (a ring step's partial lse feeds the merge), d lse_i / d score_ij = p_ij adds p_ij dlse_i to d score_ij:
    # the same form with delta_i - dlse_i, so both gradients flow through one pass.
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [batch, tq, heads]
    if dlse is not None:
        delta = delta - dlse
    bq, nq = _padded_blocks(tq, block_q)
    bk, nk = _padded_blocks(tk, block_kv)
    q, dout, q_seg, q_index = _pad(q, 1, bq), _pad(dout, 1, bq), _pad(q_seg, 1, bq), _pad(q_index, 0, bq)
    lse, delta = _pad(lse, 1, bq, -jnp.inf), _pad(delta, 1, bq)
    k, v, kv_seg, kv_index = _pad(k, 1, bk), _pad(v, 1, bk), _pad(kv_seg, 1, bk), _pad(kv_index, 0, bk)
    visible = visible_blocks(block_summary(q_seg, q_index, bq), block_summary(kv_seg, kv_index, bk), causal=causal)
    visible_t = jnp.swapaxes(visible, 1, 2)  # [batch, nk, nq]
    first, last = _block_ranges(visible_t)

    def kv_block(dq, flat):
        b, j = flat // nk, flat % nk
        k_blk, v_blk = _take_block(k, b, j, bk), _take_block(v, b, j, bk)
        kv_seg_blk, kv_idx_blk = _take_block(kv_seg, b, j, bk), lax.dynamic_slice_in_dim(kv_index, j * bk, bk)

        def update(i, carry):
            dq, dk_blk, dv_blk = carry
            q_blk = _take_block(q, b, i, bq).reshape(bq, kv_heads, group, dqk)
            do_blk = _take_block(dout, b, i, bq).reshape(bq, kv_heads, group, dv)
            lse_blk = _take_block(lse, b, i, bq).reshape(bq, kv_heads, group, 1)
            delta_blk = _take_block(delta, b, i, bq).reshape(bq, kv_heads, group, 1)
            mask = _block_mask(
                _take_block(q_seg, b, i, bq),
                kv_seg_blk,
                lax.dynamic_slice_in_dim(q_index, i * bq, bq),
                kv_idx_blk,
                causal,
            )
            s = _scores(q_blk, k_blk, scale)
            p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lse_blk), lse_blk, 0.0)), 0.0)
            dp = jnp.einsum("qhgd,khd->qhgk", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_blk)).astype(q.dtype)
            dq_blk = jnp.einsum("qhgk,khd->qhgd", ds, k_blk, preferred_element_type=jnp.float32) * scale
            dq_blk = _take_block(dq, b, i, bq) + dq_blk.reshape(bq, heads, dqk)
            dq = lax.dynamic_update_slice(dq, dq_blk[None], (b, i * bq, 0, 0))
            dk_blk = dk_blk + jnp.einsum("qhgk,qhgd->khd", ds, q_blk, preferred_element_type=jnp.float32) * scale
            dv_blk = dv_blk + jnp.einsum(
                "qhgk,qhgd->khd", p.astype(dout.dtype), do_blk, preferred_element_type=jnp.float32
            )
            return dq, dk_blk, dv_blk

        def step(i, carry):
            return lax.cond(visible_t[b, j, i], functools.partial(update, i), lambda c: c, carry)

        init = (dq, jnp.zeros((bk, kv_heads, dqk), jnp.float32), jnp.zeros((bk, kv_heads, dv), jnp.float32))
        dq, dk_blk, dv_blk = lax.fori_loop(first[b, j], last[b, j], step, init)
        return dq, (dk_blk, dv_blk)

    dq0 = jnp.zeros((batch, nq * bq, heads, dqk), jnp.float32)
    dq, (dk, dv_) = lax.scan(kv_block, dq0, jnp.arange(batch * nk))
    dk = dk.reshape(batch, nk * bk, kv_heads, dqk)[:, :tk]
    dv_ = dv_.reshape(batch, nk * bk, kv_heads, dv)[:, :tk]
    return (
        dq[:, :tq].astype(grad_dtype or q.dtype),
        dk.astype(grad_dtype or k.dtype),
        dv_.astype(grad_dtype or v.dtype),
    )
