"""Grouped-query self-attention with rotary embeddings; the attention itself is `parallel.attention`, the
projections gather tokens (`parallel.gather`) and reduce-scatter them (`parallel.project_scatter`)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import parallel
from layers.params import normal_param
from layers.rope import apply_rope, inverse_frequencies


class Attention(nnx.Module):
    """GQA/MQA attention: x [batch, length, embed] -> [batch, length, embed]."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float,
        rope_scaling=None,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        inv_freq, self.rope_factor = inverse_frequencies(head_dim, rope_theta, rope_scaling)
        self.inv_freq = tuple(float(f) for f in inv_freq)
        self.q = normal_param(
            rngs, (embed_dim, num_heads, head_dim), embed_dim, ("embed", "heads", "head_dim"), param_dtype
        )
        self.k = normal_param(
            rngs, (embed_dim, num_kv_heads, head_dim), embed_dim, ("embed", "kv_heads", "head_dim"), param_dtype
        )
        self.v = normal_param(
            rngs, (embed_dim, num_kv_heads, head_dim), embed_dim, ("embed", "kv_heads", "head_dim"), param_dtype
        )
        self.o = normal_param(
            rngs, (num_heads, head_dim, embed_dim), num_heads * head_dim, ("heads", "head_dim", "embed"), param_dtype
        )

    def __call__(self, x, positions, segment_ids=None):
        """x: [batch, length, embed] (the residual stream's layout, scattered over `tensor` under scattered tensor
        parallelism), positions/segment_ids: [batch, length] -> [batch, length, embed] in x's layout."""
        tokens = parallel.gather(x.astype(self.dtype))
        q = checkpoint_name(tokens.project("bte,ehd->bthd", self.q[...].astype(self.dtype), "h"), "q_proj")
        k = checkpoint_name(tokens.project("bte,ehd->bthd", self.k[...].astype(self.dtype), "h", repeat=True), "k_proj")
        v = checkpoint_name(tokens.project("bte,ehd->bthd", self.v[...].astype(self.dtype), "h", repeat=True), "v_proj")
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q = apply_rope(q, positions, inv_freq, self.rope_factor)
        k = apply_rope(k, positions, inv_freq, self.rope_factor)
        out = parallel.attention(q, k, v, segment_ids=segment_ids, causal=True, scale=self.head_dim**-0.5)
        return checkpoint_name(
            parallel.project_scatter("bthd,hde->bte", out, self.o[...].astype(self.dtype), "h"), "o_proj"
        )
