"""DeepSeek-V3.2's lightning indexer (Hugging Face `DeepseekV32Indexer`, GLM-5's `GlmMoeDsaIndexer`): per token, index
queries from MLA's query latent, one indexer key and a weight per index head, whose scores choose the keys sparse
attention reads (`parallel.sparse_attention`). Hugging Face wq_b, wk, k_norm, weights_proj map to wq_b, wk, k_norm,
weights; a Linear weight [out, in] is our kernel [in, ...out] transposed."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import parallel
from layers.norm import LayerNorm
from layers.params import normal_param
from layers.rope import apply_rope


class Indexer(nnx.Module):
    """q_latent [batch, length, q_lora] (MLA's normed query latent), x [batch, length, embed] -> parallel.IndexerOutput:
    queries [batch, length, heads, head_dim], keys [batch, length, head_dim] and weights [batch, length, heads] with
    the softmax scale head_dim^-0.5 and heads^-0.5 folded in (relu(c s) = c relu(s) for c > 0). The first `rope_dim`
    features of queries and keys are rotated, half-split (DeepSeek-V3.2) or in interleaved pairs (GLM-5)."""

    def __init__(
        self, embed_dim: int, q_lora_rank: int, *, heads: int, head_dim: int, rope_dim: int, interleaved: bool,
        param_dtype=jnp.float32, dtype=jnp.float32, rngs: nnx.Rngs,
    ):  # fmt: skip
        self.rope_dim, self.interleaved, self.dtype = rope_dim, interleaved, dtype
        self.weight_scale = (heads * head_dim) ** -0.5
        self.wq_b = normal_param(
            rngs, (q_lora_rank, heads, head_dim), q_lora_rank, ("q_lora", "index_heads", "head_dim"), param_dtype
        )
        self.wk = normal_param(rngs, (embed_dim, head_dim), embed_dim, ("embed", "head_dim"), param_dtype)
        self.k_norm = LayerNorm(head_dim, eps=1e-6, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        self.weights = normal_param(rngs, (embed_dim, heads), embed_dim, ("embed", "index_heads"), param_dtype)

    def __call__(self, q_latent, x, positions, inv_freq, rope_factor: float = 1.0) -> parallel.IndexerOutput:
        """positions [batch, length]; inv_freq [rope_dim // 2] and rope_factor: MLA's rotary embedding."""
        x = x.astype(self.dtype)
        rope = lambda y: jnp.concatenate(
            [
                apply_rope(y[..., : self.rope_dim], positions, inv_freq, rope_factor, interleaved=self.interleaved),
                y[..., self.rope_dim :],
            ],
            -1,
        )
        queries = rope(jnp.einsum("btr,rhd->bthd", q_latent.astype(self.dtype), self.wq_b[...].astype(self.dtype)))
        keys = rope(self.k_norm(x @ self.wk[...].astype(self.dtype))[:, :, None])[:, :, 0]
        weights = (x @ self.weights[...].astype(self.dtype)).astype(jnp.float32) * self.weight_scale
        return parallel.IndexerOutput(queries, keys, weights)
