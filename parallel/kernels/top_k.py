"""The lightning indexer's selection (DeepSeek-V3.2's sparse attention): for each query, the `count` visible keys of
highest index score score[s, t] = sum_h w[s, h] relu(q[s, h] . k[t]), found by blocks of queries over blocks of keys
with a running top-k, so memory is O(T * count) and no [tq, tk] score matrix exists. What a query may see is the
attention kernels' (parallel.kernels.arguments): segment ids, causality and windows by global index."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.blockwise import (
    SKIP,
    block_ranges,
    pad,
    pad_keys,
    pad_queries,
    padded_blocks,
    pair_kinds,
    pair_mask,
    side_block,
    take_block,
)
from parallel.kernels.visible import LOOP, loop_trips


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
    recomputes the scores of the selection."""
    q, weights, k = (lax.stop_gradient(x) for x in (q, weights, k))
    batch, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    if not 0 < count <= tk:
        raise ValueError(f"top-k count {count}: give 1 to the {tk} keys")
    bq, nq = padded_blocks(tq, options.block_q)
    bk, _ = padded_blocks(tk, options.block_kv)
    q, weights, q_tokens = pad(q, 1, bq), pad(weights, 1, bq), pad_queries(q_tokens, bq)
    k, kv_tokens = pad(k, 1, bk), pad_keys(kv_tokens, bk)
    kinds = pair_kinds(q_tokens, kv_tokens, bq, bk, options)
    first, last = block_ranges(kinds > SKIP)
    trips = loop_trips(q_tokens, kv_tokens, options, kinds.shape[-1])

    def q_block(flat):
        b, i = flat // nq, flat % nq
        q_blk, w_blk = take_block(q, b, i, bq), take_block(weights, b, i, bq)
        q_side = side_block(q_tokens, b, i, bq)

        def merge(j, best: Selection) -> Selection:
            s = index_scores(q_blk, w_blk, take_block(k, b, j, bk))
            visible = pair_mask(q_side, side_block(kv_tokens, b, j, bk), causal=options.causal, window=options.window)
            scores = jnp.concatenate([best.scores, jnp.where(visible, s, -jnp.inf)], -1)
            positions = jnp.concatenate([best.selected, jnp.broadcast_to(j * bk + jnp.arange(bk), (bq, bk))], -1)
            # best first, equal scores by global index: the same keys whatever the layout's order
            negated, _, positions = lax.sort((-scores, kv_tokens.index[positions], positions), num_keys=2)
            return Selection(positions[:, :count], -negated[:, :count])

        def step(j, best):
            return lax.cond(kinds[b, i, j] > SKIP, merge, lambda _, best: best, j, best)

        none = Selection(jnp.zeros((bq, count), jnp.int32), jnp.full((bq, count), -jnp.inf, jnp.float32))
        with jax.named_scope(LOOP.format(trips=trips)):  # bounds decided at run time: the trips the estimate costs
            return lax.fori_loop(first[b, i], last[b, i], step, none)

    selected, scores = (x.reshape(batch, nq * bq, count)[:, :tq] for x in lax.map(q_block, jnp.arange(batch * nq)))
    return Selection(jnp.where(scores > -jnp.inf, selected, 0), scores)
