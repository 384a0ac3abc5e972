"""DeepSeek-V2/V3 multi-head latent attention (Hugging Face `DeepseekV3Attention`) over `parallel.attention`; with
`index_topk`, DeepSeek-V3.2's sparse form (`DeepseekV32Attention`): the indexer (layers/indexer.py) picks each query's
index_topk keys for `parallel.sparse_attention` on rows longer than that, and learns from its loss there (`attend`);
with `index_warmup`, attention stays dense and the indexer learns against it (`parallel.indexer_warmup`). The
indexer reads its inputs without gradient: its loss trains it alone.
Hugging Face q_a_proj, q_a_layernorm, q_b_proj, q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj map to
q_a, q_a_norm, q_b, q, kv_a, kv_a_norm, kv_b, o; a Linear weight [out, in] is our kernel [in, ...out] transposed.
q_a_norm / kv_a_norm use eps 1e-6 (`norm_eps`' default) whatever the model's norm eps, as DeepSeek's and
transformers' latent norms do."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import parallel
from layers.indexer import Indexer
from layers.norm import RMSNorm
from layers.params import normal_param
from layers.rope import apply_rope, inverse_frequencies, yarn_softmax_scale


class MLA(nnx.Module):
    """Low-rank query (optional) and key/value with one rotary key shared by all heads:
    x [batch, length, embed] -> [batch, length, embed]; query/key head dim nope + rope, value head dim v."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope_theta: float,
        rope_scaling=None,
        norm_eps: float = 1e-6,
        index_topk: int = 0,
        index_heads: int = 0,
        index_head_dim: int = 0,
        index_rope_interleaved: bool = False,
        index_warmup: bool = False,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.q_lora_rank, self.kv_lora_rank, self.dtype = q_lora_rank, kv_lora_rank, dtype
        self.qk_nope_head_dim = qk_nope_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        inv_freq, self.rope_factor = inverse_frequencies(qk_rope_head_dim, rope_theta, rope_scaling)
        self.inv_freq = tuple(float(f) for f in inv_freq)
        self.scale = qk_head_dim**-0.5 * yarn_softmax_scale(rope_scaling)
        norm = dict(eps=norm_eps, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        if q_lora_rank > 0:
            self.q_a = normal_param(rngs, (embed_dim, q_lora_rank), embed_dim, ("embed", "q_lora"), param_dtype)
            self.q_a_norm = RMSNorm(q_lora_rank, **norm)
            self.q_b = normal_param(
                rngs, (q_lora_rank, num_heads, qk_head_dim), q_lora_rank, ("q_lora", "heads", "head_dim"), param_dtype
            )
        else:
            self.q = normal_param(
                rngs, (embed_dim, num_heads, qk_head_dim), embed_dim, ("embed", "heads", "head_dim"), param_dtype
            )
        self.kv_a = normal_param(
            rngs, (embed_dim, kv_lora_rank + qk_rope_head_dim), embed_dim, ("embed", "kv_lora"), param_dtype
        )
        self.kv_a_norm = RMSNorm(kv_lora_rank, **norm)
        self.kv_b = normal_param(
            rngs,
            (kv_lora_rank, num_heads, qk_nope_head_dim + v_head_dim),
            kv_lora_rank,
            ("kv_lora", "heads", "head_dim"),
            param_dtype,
        )
        self.o = normal_param(
            rngs,
            (num_heads, v_head_dim, embed_dim),
            num_heads * v_head_dim,
            ("heads", "head_dim", "embed"),
            param_dtype,
        )
        self.index_topk, self.index_warmup = index_topk, index_warmup
        indexer_args = dict(heads=index_heads, head_dim=index_head_dim, rope_dim=qk_rope_head_dim)
        indexer_args |= dict(interleaved=index_rope_interleaved, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        self.indexer = Indexer(embed_dim, q_lora_rank, **indexer_args) if index_topk else None

    def __call__(self, x, positions, segment_ids=None):
        """x: [batch, length, embed] in the residual stream's layout, positions/segment_ids: [batch, length] ->
        [batch, length, embed] in x's layout (`attend` without the indexer's loss)."""
        return self.attend(x, positions, segment_ids)[0]

    def attend(self, x, positions, segment_ids=None):
        """x: [batch, length, embed] in the residual stream's layout, positions/segment_ids: [batch, length] ->
        ([batch, length, embed] in x's layout, the indexer's report: {} where it does not run, else {"indexer_loss":
        its loss summed over each row's queries, "indexer_tokens": their number}, each [batch] float32). Under
        scattered tensor parallelism the down-projections and their norms run on the scattered tokens and only their
        outputs (q_lora + kv_lora + rope features; the hidden size instead of q_lora without query low-rank) are
        gathered."""
        x = x.astype(self.dtype)
        if self.q_lora_rank > 0:
            query_in = self.q_a_norm(checkpoint_name(x @ self.q_a[...].astype(self.dtype), "q_a_proj"))
            q_kernel = self.q_b[...]
        else:
            query_in, q_kernel = x, self.q[...]
        kv_low = checkpoint_name(x @ self.kv_a[...].astype(self.dtype), "kv_a_proj")
        normed = self.kv_a_norm(kv_low[..., : self.kv_lora_rank])
        tokens = parallel.gather(jnp.concatenate([query_in, normed, kv_low[..., self.kv_lora_rank :]], axis=-1))
        q_width = query_in.shape[-1]
        q = tokens.features(0, q_width).project("btr,rhd->bthd", q_kernel.astype(self.dtype), "h")
        q = checkpoint_name(q, "q_proj")
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        rope = lambda x: apply_rope(x, positions, inv_freq, self.rope_factor, interleaved=True)
        # the latent with its rotated key part: what K/V expand from, and what a ring rotates in their place
        rotated = tokens.features(q_width).map(
            lambda x: jnp.concatenate(
                [x[..., : self.kv_lora_rank], rope(x[:, :, None, self.kv_lora_rank :])[:, :, 0]], -1
            )
        )
        kv_b = self.kv_b[...].astype(self.dtype)
        q_pe = rope(q[..., self.qk_nope_head_dim :])
        query = jnp.concatenate([q[..., : self.qk_nope_head_dim], q_pe], axis=-1)
        latent = parallel.Latent(rotated, kv_b, self.qk_nope_head_dim)
        indexer_out = None
        if self.indexer is not None and (self.index_warmup or x.shape[1] > self.index_topk):
            detached = lax.stop_gradient  # the indexer learns from its own loss only
            indexer_out = self.indexer(detached(query_in), detached(x), positions, inv_freq, self.rope_factor)
        kw = dict(segment_ids=segment_ids, scale=self.scale)
        if indexer_out is not None and not self.index_warmup:
            out, kl = parallel.sparse_attention(query, latent, indexer_out=indexer_out, count=self.index_topk, **kw)
        else:  # every visible key (a row no longer than index_topk selects them all): dense attention
            kv = rotated.features(0, self.kv_lora_rank).project("btr,rhd->bthd", kv_b, "h")
            k_nope = checkpoint_name(kv[..., : self.qk_nope_head_dim], "k_proj")
            value = checkpoint_name(kv[..., self.qk_nope_head_dim :], "v_proj")
            k_pe = rotated.features(self.kv_lora_rank).per_head(q.shape[2])
            key = jnp.concatenate([k_nope, k_pe], axis=-1)
            out = parallel.attention(query, key, value, causal=True, latent=latent, **kw)
            kl = None if indexer_out is None else parallel.indexer_warmup(query, latent, indexer_out=indexer_out, **kw)
        out = parallel.project_scatter("bthd,hde->bte", out, self.o[...].astype(self.dtype), "h")
        return checkpoint_name(out, "o_proj"), {} if kl is None else _indexer_report(kl, segment_ids)


def _indexer_report(kl, segment_ids) -> dict:
    """The indexer's loss per query [batch, length] -> its sum and the number of queries (not padding) per row."""
    queries = jnp.ones(kl.shape) if segment_ids is None else (segment_ids > 0).astype(jnp.float32)
    return {"indexer_loss": kl.sum(1), "indexer_tokens": queries.sum(1)}
