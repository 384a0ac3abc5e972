"""The lightning indexer's loss (DeepSeek-V3.2): per query, the KL divergence from the main attention's distribution
over its keys (the heads' probabilities summed, L1-normalised) to the softmax of its index scores over the same keys.
Sparse training takes it over each query's selection (`selection_kl`); the dense warm-up over every visible key
(`dense_kl`), by blocks of keys as flash attention runs, so no [tq, tk] array exists. Differentiable in the indexer's
queries, weights and keys only: the attention side is a fixed target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.blockwise import (
    pad,
    pad_keys,
    pad_queries,
    padded_blocks,
    pair_mask,
    side_block,
    take_block,
)
from parallel.kernels.softmax import finish_lse, safe_shift
from parallel.kernels.top_k import Selection, index_scores


def selection_kl(q, weights, k, selection: Selection, target, *, block_q: int = 64):
    """q [batch, tq, heads, d], weights [batch, tq, heads], k [batch, tk, d] (the indexer's); each query's `selection`
    [batch, tq, count] and `target` [batch, tq, count] (the attention's probability of each selected key, summing to
    1 over them) -> KL(target || softmax of the selected keys' index scores) per query [batch, tq] float32, 0 for a
    query without keys."""
    batch, tq = q.shape[:2]
    bq, nq = padded_blocks(tq, block_q)
    q, weights = pad(q, 1, bq), pad(weights, 1, bq)
    selected, valid = pad(selection.selected, 1, bq), pad(selection.valid, 1, bq)
    target = pad(lax.stop_gradient(target).astype(jnp.float32), 1, bq)

    @jax.checkpoint  # the backward regathers a block's keys rather than keep every block's [bq, count, d]
    def q_block(flat):
        b, i = flat // nq, flat % nq
        rows = lambda x: take_block(x, b, i, bq)
        scores = index_scores(rows(q)[:, None], rows(weights)[:, None], k[b][rows(selected)])[:, 0]
        return _kl(rows(target), scores, rows(valid))

    return lax.map(q_block, jnp.arange(batch * nq)).reshape(batch, nq * bq)[:, :tq]


def _kl(p, logits, valid):
    """sum over the `valid` slots of p (log p - log softmax(logits)): [..., n] each -> [...]; 0 where none is valid."""
    logits = jnp.where(valid, logits, 0.0)
    lse = jax.nn.logsumexp(logits, axis=-1, where=valid, keepdims=True)
    lse = jnp.where(valid.any(-1, keepdims=True), lse, 0.0)
    return jnp.sum(jnp.where(valid, _x_log_x(p) - p * (logits - lse), 0.0), -1)


def _x_log_x(p):
    """p log p, 0 at p = 0."""
    return jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)


def dense_kl(
    q, k, indexer_q, weights, indexer_k, q_tokens: Tokens, kv_tokens: Tokens, *, scale: float, options: Options
):  # fmt: skip
    """The attention's q [batch, tq, heads, dqk] and k [batch, tk, kv_heads, dqk], the indexer's queries indexer_q
    [batch, tq, index_heads, d], weights [batch, tq, index_heads] and keys indexer_k [batch, tk, d], both sides' tokens
    -> KL(p || softmax of the index scores) over every visible key, per query [batch, tq] float32 (0 without keys),
    where p is the attention's probabilities summed over heads / heads. Two passes over every key block per query block
    (scans of static length, no branch per block: an invisible block adds nothing): the log-sum-exps of the attention
    (each head) and of the index scores, then sum p log p and sum p x index score."""
    q, k = lax.stop_gradient(q), lax.stop_gradient(k)
    batch, tq, heads, dqk = q.shape
    kv_heads, tk = k.shape[2], k.shape[1]
    group = heads // kv_heads
    bq, nq = padded_blocks(tq, options.block_q)
    bk, nk = padded_blocks(tk, options.block_kv)
    q, indexer_q, weights, q_tokens = (
        pad(q, 1, bq),
        pad(indexer_q, 1, bq),
        pad(weights, 1, bq),
        pad_queries(q_tokens, bq),
    )
    k, indexer_k, kv_tokens = pad(k, 1, bk), pad(indexer_k, 1, bk), pad_keys(kv_tokens, bk)

    @jax.checkpoint
    def q_block(flat):
        b, i = flat // nq, flat % nq
        q_blk = take_block(q, b, i, bq).reshape(bq, kv_heads, group, dqk)
        indexer_q_blk, w_blk, q_side = (
            take_block(indexer_q, b, i, bq),
            take_block(weights, b, i, bq),
            side_block(q_tokens, b, i, bq),
        )

        def scores(j):
            """The block pair's attention scores [bq, kv_heads, group, bk] and index scores [bq, bk], -inf where not
            visible."""
            mask = pair_mask(q_side, side_block(kv_tokens, b, j, bk), causal=options.causal, window=options.window)
            s = jnp.einsum("qhgd,khd->qhgk", q_blk, take_block(k, b, j, bk), preferred_element_type=jnp.float32)
            indexer_s = index_scores(indexer_q_blk, w_blk, take_block(indexer_k, b, j, bk))
            return jnp.where(mask[:, None, None], s * scale, -jnp.inf), jnp.where(mask, indexer_s, -jnp.inf)

        def lse_step(carry, j):
            (top, total), (indexer_top, indexer_total) = carry
            s, indexer_s = scores(j)
            return (_online(top, total, s), _online(indexer_top, indexer_total, indexer_s)), None

        def kl_step(sums, j):
            s, indexer_s = scores(j)
            p = jnp.exp(s - attention_lse[..., None]).sum((1, 2)) / heads  # [bq, bk]
            return (sums[0] + _x_log_x(p).sum(-1), sums[1] + jnp.where(p > 0, p * indexer_s, 0.0).sum(-1)), None

        start = lambda shape: (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32))
        steps = jnp.arange(nk)
        attention, indexer = lax.scan(jax.checkpoint(lse_step), (start((bq, kv_heads, group)), start((bq,))), steps)[0]
        attention_lse = lax.stop_gradient(finish_lse(*attention))
        zero = jnp.zeros((bq,), jnp.float32)
        (entropy, cross), _ = lax.scan(jax.checkpoint(kl_step), (zero, zero), steps)
        indexer_lse = finish_lse(*indexer)
        return jnp.where(jnp.isfinite(indexer_lse), entropy - cross + indexer_lse, 0.0)

    return lax.map(q_block, jnp.arange(batch * nq)).reshape(batch, nq * bq)[:, :tq]


def _online(top, total, s):
    """A running log-sum-exp (top: the maximum so far, held without gradient; total: sum exp(s - top)) updated with
    the scores s [..., bk]."""
    new_top = lax.stop_gradient(jnp.maximum(top, jnp.max(s, -1)))
    safe = safe_shift(new_top)
    return new_top, total * jnp.exp(jnp.where(jnp.isfinite(top), top - safe, -jnp.inf)) + jnp.exp(
        s - safe[..., None]
    ).sum(-1)
