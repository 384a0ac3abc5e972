"""Llama 2 / 3 / 3.1 / 3.2: pre-norm decoder blocks (RMSNorm, GQA attention with RoPE, SwiGLU), scanned.

Versions differ only in config fields (heads, kv heads, rope theta and scaling, tied embeddings).
"""

from __future__ import annotations

from flax import nnx

import parallel
from layers.attention import Attention
from layers.embed import Embed, OutputHead
from layers.mlp import SwiGLU
from layers.norm import RMSNorm
from models.decoder import Decoder, default_positions
from models.dtypes import compute_dtype, param_dtype
from models.stack import make_stack, run_stack


class Block(nnx.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); x: [batch, length, embed]."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        kw = dict(param_dtype=param_dtype(config), dtype=compute_dtype(config))
        self.attn_norm = RMSNorm(config.embed_dim, eps=config.norm_eps, rngs=rngs, **kw)
        self.attn = Attention(config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim,
                              rope_theta=config.rope_theta, rope_scaling=config.rope_scaling, rngs=rngs, **kw)
        self.mlp_norm = RMSNorm(config.embed_dim, eps=config.norm_eps, rngs=rngs, **kw)
        self.mlp = SwiGLU(config.embed_dim, config.mlp_dim, rngs=rngs, **kw)

    def __call__(self, x, positions, segment_ids):
        """-> (x, None): a block carries nothing beside the residual stream."""
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        x = x + self.mlp(self.mlp_norm(x))
        return parallel.residual(x), None


class Llama(Decoder):
    """tokens [batch, length] -> hidden [batch, length, embed] -> logits [batch, length, vocab]."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        self.config = config
        kw = dict(param_dtype=param_dtype(config), dtype=compute_dtype(config))
        self.embed = Embed(config.vocab_size, config.embed_dim, rngs=rngs, **kw)
        self.layers = make_stack(lambda rngs: Block(config, rngs=rngs), config.num_layers, rngs)
        self.final_norm = RMSNorm(config.embed_dim, eps=config.norm_eps, rngs=rngs, **kw)
        self.head = None if config.tie_embeddings else OutputHead(config.embed_dim, config.vocab_size, rngs=rngs, **kw)

    def hidden(self, tokens, positions=None, segment_ids=None):
        """tokens/positions/segment_ids: [batch, length] -> (final-normed hidden [batch, length, embed], aux {})."""
        positions = default_positions(tokens, positions)
        x = parallel.residual(self.embed(tokens))
        x, _ = run_stack(self.layers, x, positions, segment_ids, remat_policy=self.config.remat_policy)
        return parallel.shard(self.final_norm(x), ("batch", "length", "embed")), {}
