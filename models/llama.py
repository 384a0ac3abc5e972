"""Llama 2 / 3 / 3.1 / 3.2: pre-norm decoder blocks (RMSNorm, GQA attention with RoPE, SwiGLU), scanned.

Versions differ only in config fields (heads, kv heads, rope theta and scaling, tied embeddings).
"""

from __future__ import annotations

from flax import nnx

import parallel
from layers.attention import Attention
from layers.mlp import SwiGLU
from layers.norm import RMSNorm
from models.config import ComputeConfig, ModelConfig
from models.decoder import Decoder
from models.stack import make_stack, run_stack


class Block(nnx.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); x: [batch, length, embed]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, **kw):
        self.attn_norm = RMSNorm(config.embed_dim, eps=config.norm_eps, rngs=rngs, **kw)
        self.attn = Attention(
            config.embed_dim,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            rngs=rngs,
            **kw,
        )
        self.mlp_norm = RMSNorm(config.embed_dim, eps=config.norm_eps, rngs=rngs, **kw)
        self.mlp = SwiGLU(config.embed_dim, config.mlp_dim, rngs=rngs, **kw)

    def __call__(self, x, positions, segment_ids):
        """-> (x, None): a block carries nothing beside the residual stream."""
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        x = x + self.mlp(self.mlp_norm(x))
        return parallel.residual(x), None


class Llama(Decoder):
    """A stack of `num_layers` blocks between the shared embedding and head (see models/decoder.py)."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        super().__init__(config, compute, rngs=rngs)
        self.layers = make_stack(lambda r: Block(config, rngs=r, **self.dtypes()), config.num_layers, rngs)

    def blocks(self, x, positions, segment_ids):
        """-> (x, {}): Llama blocks report nothing."""
        x, _ = run_stack(self.layers, x, positions, segment_ids, remat_policy=self.compute.remat_policy)
        return x, {}
