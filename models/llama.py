"""Llama-style decoder: pre-norm blocks (RMSNorm, grouped-query attention with RoPE, SwiGLU), scanned.

Llama 2 / 3 / 3.1 / 3.2, Qwen2 / 2.5, Qwen3 and Mistral (without a sliding window) differ only in config fields:
heads, rope theta and scaling, tied embeddings, q/k/v biases (`qkv_bias`) and q/k norms (`qk_norm`).
"""

from __future__ import annotations

from flax import nnx

from layers.attention import Attention
from models import block
from models.config import ComputeConfig, ModelConfig
from models.decoder import Decoder
from models.stack import make_stack, run_stack


def attention(config: ModelConfig, *, rngs: nnx.Rngs, **kw) -> Attention:
    """The grouped-query attention of `config` (biases and q/k norms as its fields say)."""
    return Attention(
        config.embed_dim,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm,
        norm_eps=config.norm_eps,
        rngs=rngs,
        **kw,
    )


class Block(block.Block):
    """A block with grouped-query attention: dense, or with `moe` a mixture-of-experts block (models/mixtral.py)."""

    def __init__(self, config: ModelConfig, *, moe: bool = False, rngs: nnx.Rngs, **kw):
        super().__init__(config, attention(config, rngs=rngs, **kw), moe=moe, rngs=rngs, **kw)


class Llama(Decoder):
    """A stack of `num_layers` dense blocks between the shared embedding and head (see models/decoder.py)."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        super().__init__(config, compute, rngs=rngs)
        self.layers = make_stack(lambda r: Block(config, rngs=r, **self.dtypes()), config.num_layers, rngs)

    def blocks(self, x, positions, segment_ids):
        """-> (x, {}): dense blocks report nothing."""
        x, _ = run_stack(self.layers, x, positions, segment_ids, remat_policy=self.compute.remat_policy)
        return x, {}
