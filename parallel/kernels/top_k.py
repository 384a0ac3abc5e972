"""The lightning indexer's selection (DeepSeek-V3.2's sparse attention): for each query, the `count` visible keys of
highest index score score[s, t] = sum_h w[s, h] relu(q[s, h] . k[t]), found per block of queries from its row of
scores: memory O(T x count) for the selection and O(block_q x T) for a block's row, no [tq, tk] score matrix. What a
query may see is the attention kernels' (parallel.kernels.arguments): segment ids, causality and windows by global
index."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.blockwise import pad, pad_keys, pad_queries, padded_blocks, pair_mask, side_block, take_block


class Selection(NamedTuple):
    """Each query's selected keys, best first: positions in the keys' array [batch, tq, count] int32 and their index
    scores [batch, tq, count] float32; a slot with no key (a query that sees fewer than `count`) has score -inf and
    position 0."""

    selected: jax.Array
    scores: jax.Array

    @property
    def valid(self) -> jax.Array:
        """[batch, tq, count] bool: the slot holds a visible key."""
        return self.scores > -jnp.inf


def index_scores(q, weights, k):
    """q [..., s, heads, d], weights [..., s, heads], k [..., t, d] -> [..., s, t] float32 index scores
    sum_h weights[s, h] relu(q[s, h] . k[t])."""
    dots = jnp.einsum("...shd,...td->...sht", q, k, preferred_element_type=jnp.float32)
    return jnp.einsum("...sh,...sht->...st", weights.astype(jnp.float32), jax.nn.relu(dots))


def top_k(q, weights, k, q_tokens: Tokens, kv_tokens: Tokens, *, count: int, options: Options) -> Selection:
    """q [batch, tq, heads, d], weights [batch, tq, heads], k [batch, tk, d]; both sides' tokens given -> the
    Selection of each query's `count` (at most tk) best visible keys by index score, of equal scores the earliest
    (by global index, so any layout of the keys selects the same ones). Not differentiable: the indexer's loss
    recomputes the scores of the selection.

    Per block of `block_q` queries (a map): the scores against every key, `block_kv` keys at a time by a loop of
    static trip count with the heads reduced inside each block ([block_q, heads, block_kv] at most), written into
    the block's [block_q, tk] row of scores in global key order with the invisible pairs at -inf; then one top-k of
    that row, whose ties go to the earlier key. No loop bound or branch is decided at run time (on a GPU each would
    read a value back to the host), at the cost of scoring the invisible key blocks too."""
    q, weights, k = (lax.stop_gradient(x) for x in (q, weights, k))
    batch, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    if not 0 < count <= tk:
        raise ValueError(f"top-k count {count}: give 1 to the {tk} keys")
    bq, nq = padded_blocks(tq, options.block_q)
    bk, nk = padded_blocks(tk, options.block_kv)
    q, weights, q_tokens = pad(q, 1, bq), pad(weights, 1, bq), pad_queries(q_tokens, bq)
    index = kv_tokens.index  # the keys in global order: static where the layout is
    order = np.argsort(index, kind="stable") if isinstance(index, np.ndarray) else jnp.argsort(index, stable=True)
    k = pad(jnp.take(k, order, axis=1), 1, bk)
    kv_tokens = pad_keys(Tokens(jnp.take(kv_tokens.segment_ids, order, axis=1), index[order]), bk)
    position = pad(jnp.asarray(order, jnp.int32), 0, bk)  # of each key in global order, in the keys' array

    def q_block(flat):
        b, i = flat // nq, flat % nq
        q_blk, w_blk = take_block(q, b, i, bq), take_block(weights, b, i, bq)
        q_side = side_block(q_tokens, b, i, bq)

        def score(j, row):
            s = index_scores(q_blk, w_blk, take_block(k, b, j, bk))
            visible = pair_mask(q_side, side_block(kv_tokens, b, j, bk), causal=options.causal, window=options.window)
            return lax.dynamic_update_slice_in_dim(row, jnp.where(visible, s, -jnp.inf), j * bk, axis=1)

        row = lax.fori_loop(0, nk, score, jnp.full((bq, nk * bk), -jnp.inf, jnp.float32))
        scores, best = lax.top_k(row, count)
        return jnp.where(scores > -jnp.inf, position[best], 0), scores

    selected, scores = (x.reshape(batch, nq * bq, count)[:, :tq] for x in lax.map(q_block, jnp.arange(batch * nq)))
    return Selection(selected, scores)
