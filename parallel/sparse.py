"""DeepSeek sparse attention (DSA, DeepSeek-V3.2 and GLM-5): the indexer's scores choose each query's `count` best
visible keys (parallel.kernels.top_k) and attention reads only those (parallel.kernels.sparse). MLA's latent is the
one key and value every head shares there (the absorbed form DeepSeek runs), so a query block gathers
kv_lora + rope numbers per selected key, not heads x (nope + rope + dv). (A row no longer than `count` selects every
visible key: that is dense attention, which models run with `parallel.attention` under any strategy.)"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from parallel.kernels import Options, Tokens
from parallel.kernels import sparse as sparse_kernel
from parallel.kernels.top_k import top_k
from parallel.latent import Latent
from parallel.plan import current_plan


class Index(NamedTuple):
    """The indexer's output for each token: queries [batch, length, heads, d], keys [batch, length, d] and weights
    [batch, length, heads] float32 (the scales folded in); score[s, t] = sum_h weights[s, h] relu(q[s, h] . k[t])."""

    queries: jax.Array
    keys: jax.Array
    weights: jax.Array


def sparse_attention(q, k, v, *, index: Index, count: int, segment_ids=None, scale=None, latent: Latent | None = None):
    """Causal attention of each query over the `count` visible keys of highest index score. q [batch, length, heads,
    dqk], k [batch, length, heads, dqk], v [batch, length, heads, dv], `segment_ids` [batch, length] (0 = padding)
    -> [batch, length, heads, dv]. With MLA's `latent`, attention runs on it in absorbed form (k and v unused).
    The row is whole on each device (context strategy none, contiguous layout)."""
    batch, length = q.shape[:2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    plan = current_plan()
    if plan.strategy != "none" or plan.layout != "contiguous":
        raise ValueError(
            f"sparse attention (index_topk={count}, rows of {length} tokens) runs with parallel.context_strategy=none "
            f"and the contiguous layout, not {plan.strategy!r} / {plan.layout!r}"
        )
    segment_ids = jnp.ones((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    tokens = Tokens(segment_ids, jnp.arange(length, dtype=jnp.int32))
    options = Options(causal=True, block_q=64, block_kv=256)
    selection = top_k(index.queries, index.weights, index.keys, tokens, tokens, count=count, options=options)
    if latent is None:
        return sparse_kernel.attention(q, k, v, selection, scale=scale)[0]
    lora, nope = latent.kv_b.shape[0], latent.nope
    rows = latent.tokens.grouped[0]  # [batch, length, kv_lora + rope]: the normed latent, then the rotated key part
    absorbed = jnp.einsum("bthn,rhn->bthr", q[..., :nope], latent.kv_b[..., :nope])
    queries = jnp.concatenate([absorbed.astype(q.dtype), q[..., nope:]], -1)
    out, _ = sparse_kernel.attention(queries, rows[:, :, None], rows[:, :, None, :lora], selection, scale=scale)
    return jnp.einsum("bthr,rhd->bthd", out, latent.kv_b[..., nope:])
