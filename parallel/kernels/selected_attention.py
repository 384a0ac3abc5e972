"""Attention over each query's own selected keys (DeepSeek-V3.2's sparse attention, after parallel.kernels.top_k):
blocks of queries gather their selected keys and values, so work and memory go as T * count, never T^2. The backward
recomputes each block's probabilities from the saved log-sum-exp and adds the key and value gradients into their
rows in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallel.kernels.blockwise import pad, padded_blocks
from parallel.kernels.softmax import backward_delta, finish_lse, safe_shift
from parallel.kernels.top_k import Selection


def attention(q, k, v, selection: Selection, *, scale: float, block_q: int = 64):
    """q [batch, tq, heads, dqk], k [batch, tk, kv_heads, dqk], and v [batch, tk, kv_heads, dv] or an int dv: the
    values are the keys' first dv features (MLA's absorbed form, whose latent rows are both), gathered once with
    them; `selection` of [batch, tq, count] keys per query (shared by its heads) -> (out [batch, tq, heads, dv] in
    q's dtype, weights [batch, tq, count] float32: each selected key's attention probability summed over heads,
    without gradient, the indexer loss's target). A query with no selected key gets zeros. Differentiable in q, k and
    v."""
    values, v = (v, None) if isinstance(v, int) else (v.shape[-1], v)
    out, weights, _ = _attention(q, k, v, selection.selected, selection.valid, scale, block_q, values)
    return out, lax.stop_gradient(weights)


def _selected(k, v, b, at, values):
    """The selected rows `at` [bq, count] of batch row b: keys [bq, count, kv_heads, dqk] and values [bq, count,
    kv_heads, dv] (the keys' first `values` features when v is None)."""
    k_sel = k[b][at]
    return k_sel, k_sel[..., :values] if v is None else v[b][at]


def _probabilities(q_blk, k_sel, seen, scale, lse=None):
    """q_blk [bq, kv_heads, group, d], k_sel [bq, count, kv_heads, d], seen [bq, count] -> (p [bq, kv_heads, group,
    count] float32, lse [bq, kv_heads, group]); given lse, p is recomputed from it."""
    s = jnp.einsum("qhgd,qchd->qhgc", q_blk, k_sel, preferred_element_type=jnp.float32) * scale
    s = jnp.where(seen[:, None, None], s, -jnp.inf)
    if lse is None:
        top = safe_shift(jnp.max(s, -1))
        lse = finish_lse(top, jnp.exp(s - top[..., None]).sum(-1))
    return jnp.exp(s - safe_shift(lse)[..., None]), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, selected, valid, scale, block_q, values):
    return _forward(q, k, v, selected, valid, scale, block_q, values)


def _forward(q, k, v, selected, valid, scale, block_q, values):
    """(out [batch, tq, heads, dv], weights [batch, tq, count], lse [batch, tq, kv_heads, group]); v None: the keys'
    first `values` features."""
    batch, tq, heads, dqk = q.shape
    kv_heads, dv = k.shape[2], values
    group = heads // kv_heads
    bq, nq = padded_blocks(tq, block_q)
    q, selected, valid = pad(q, 1, bq), pad(selected, 1, bq), pad(valid, 1, bq)

    def q_block(flat):
        b, i = flat // nq, flat % nq
        rows = lambda x: lax.dynamic_slice_in_dim(x[b], i * bq, bq)
        k_sel, v_sel = _selected(k, v, b, rows(selected), values)
        p, lse = _probabilities(rows(q).reshape(bq, kv_heads, group, dqk), k_sel, rows(valid), scale)
        out = jnp.einsum("qhgc,qchd->qhgd", p.astype(v_sel.dtype), v_sel, preferred_element_type=jnp.float32)
        return out.reshape(bq, heads, dv).astype(q.dtype), p.sum((1, 2)), lse

    out, weights, lse = lax.map(q_block, jnp.arange(batch * nq))
    unblock = lambda x: x.reshape(batch, nq * bq, *x.shape[2:])[:, :tq]
    return unblock(out), unblock(weights), unblock(lse)


def _attention_forward(q, k, v, selected, valid, scale, block_q, values):
    out, weights, lse = _forward(q, k, v, selected, valid, scale, block_q, values)
    return (out, weights, lse), (q, k, v, selected, valid, out, lse)


def _attention_backward(scale, block_q, values, residuals, cotangents):
    """dq, dk, dv (no gradient for the selection): per query block, d score = p (dp - delta) with
    delta = dout . out; dk and dv rows are added where the block's selection points (values that are the keys'
    first features add to dk there)."""
    q, k, v, selected, valid, out, lse = residuals
    dout = cotangents[0]
    batch, tq, heads, dqk = q.shape
    kv_heads, dv = k.shape[2], values
    group = heads // kv_heads
    bq, nq = padded_blocks(tq, block_q)
    delta = backward_delta(out, dout).reshape(batch, tq, kv_heads, group)
    q, dout, selected, valid = pad(q, 1, bq), pad(dout, 1, bq), pad(selected, 1, bq), pad(valid, 1, bq)
    lse, delta = pad(lse, 1, bq, -jnp.inf), pad(delta, 1, bq)

    def q_block(grads, flat):
        dk, dv_ = grads
        b, i = flat // nq, flat % nq
        rows = lambda x: lax.dynamic_slice_in_dim(x[b], i * bq, bq)
        at = rows(selected)
        q_blk, do_blk = rows(q).reshape(bq, kv_heads, group, dqk), rows(dout).reshape(bq, kv_heads, group, dv)
        k_sel, v_sel = _selected(k, v, b, at, values)
        p, _ = _probabilities(q_blk, k_sel, rows(valid), scale, rows(lse))
        dp = jnp.einsum("qhgd,qchd->qhgc", do_blk, v_sel, preferred_element_type=jnp.float32)
        ds = p * (dp - rows(delta)[..., None]) * scale
        dq_blk = jnp.einsum("qhgc,qchd->qhgd", ds.astype(k.dtype), k_sel, preferred_element_type=jnp.float32)
        dk_sel = jnp.einsum("qhgc,qhgd->qchd", ds.astype(q.dtype), q_blk, preferred_element_type=jnp.float32)
        dv_sel = jnp.einsum("qhgc,qhgd->qchd", p.astype(dout.dtype), do_blk, preferred_element_type=jnp.float32)
        dq_blk = dq_blk.reshape(bq, heads, dqk).astype(q.dtype)
        if v is None:  # the values are the keys' first dv features
            return (dk.at[b, at].add(dk_sel.at[..., :dv].add(dv_sel)), None), dq_blk
        return (dk.at[b, at].add(dk_sel), dv_.at[b, at].add(dv_sel)), dq_blk

    zeros = lambda x: None if x is None else jnp.zeros(x.shape, jnp.float32)
    (dk, dv_), dq = lax.scan(q_block, (zeros(k), zeros(v)), jnp.arange(batch * nq))
    dq = dq.reshape(batch, nq * bq, heads, dqk)[:, :tq]
    return dq, dk.astype(k.dtype), None if v is None else dv_.astype(v.dtype), None, None


_attention.defvjp(_attention_forward, _attention_backward)
