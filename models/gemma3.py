"""Gemma 3 text decoder: grouped-query attention with q/k norms, sliding (local rope) and full (global rope) layers
as layer_types says, scanned in groups of its period; sandwich-normed blocks with a gelu-tanh gated MLP; Gemma's
norms (scale 1 + weight), embeddings times sqrt(embed_dim), the softmax scale query_pre_attn_scalar ** -0.5."""

from __future__ import annotations

from flax import nnx

import parallel
from layers.mlp import SwiGLU
from layers.norm import RMSNorm
from models import llama
from models.config import FULL, ModelConfig

NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by 1 + weight


class Block(nnx.Module):
    """x [batch, length, embed] -> (x + post_attn_norm(attn(attn_norm(x))), then + post_mlp_norm(mlp(mlp_norm(x))),
    None): Hugging Face's input / post_attention / pre_feedforward / post_feedforward layernorms."""

    def __init__(self, config: ModelConfig, kind: str = FULL, *, rngs: nnx.Rngs, **kw):
        def norm():
            return RMSNorm(config.embed_dim, eps=config.norm_eps, offset=NORM_OFFSET, rngs=rngs, **kw)

        self.attn_norm = norm()
        self.attn = llama.attention(config, kind, norm_offset=NORM_OFFSET, rngs=rngs, **kw)
        self.post_attn_norm = norm()
        self.mlp_norm = norm()
        self.mlp = SwiGLU(config.embed_dim, config.mlp_dim, activation="gelu_tanh", rngs=rngs, **kw)
        self.post_mlp_norm = norm()

    def __call__(self, x, positions, segment_ids):
        """x: [batch, length, embed], positions/segment_ids: [batch, length] -> (x, None)."""
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), positions, segment_ids))
        return parallel.residual(x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))), None


class Gemma3(llama.Llama):
    """Llama's stack of Gemma blocks of the config's layer kinds between the scaled embedding and the tied or untied
    head, behind Gemma's final norm."""

    block = Block
    norm_offset = NORM_OFFSET
    scale_embeddings = True
