"""Llama-style decoder: pre-norm blocks (RMSNorm, grouped-query attention with RoPE, SwiGLU), scanned.

Llama 2 / 3 / 3.1 / 3.2, Qwen2 / 2.5, Qwen3 and Mistral differ only in config fields: heads, rope theta and
scaling, tied embeddings, q/k/v biases (`qkv_bias`), q/k norms (`qk_norm`) and sliding windows (`sliding_window`,
`layer_types`; a stack whose layers differ scans in groups, models/stack.py).
"""

from __future__ import annotations

from flax import nnx

from layers.attention import Attention
from models import block
from models.config import FULL, SLIDING, ComputeConfig, ModelConfig
from models.decoder import Decoder
from models.stack import make_layers, run_layers


def attention(config: ModelConfig, kind: str, *, norm_offset: float = 0.0, rngs: nnx.Rngs, **kw) -> Attention:
    """The grouped-query attention of `config` in a layer of `kind` (LAYER_TYPES: a sliding one attends within
    sliding_window, rotating with local_rope_theta unscaled when that is set); biases, q/k norms (of `norm_offset`),
    sinks, the softmax scale (query_pre_attn_scalar), partial rotary and the output gate as its fields say."""
    local = kind == SLIDING and config.local_rope_theta > 0
    return Attention(
        config.embed_dim,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        rope_theta=config.local_rope_theta if local else config.rope_theta,
        rope_scaling=None if local else config.rope_scaling,
        qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm,
        o_bias=config.o_bias,
        sinks=config.attention_sinks,
        norm_eps=config.norm_eps,
        norm_offset=norm_offset,
        window=config.sliding_window if kind == SLIDING else None,
        scale=config.query_pre_attn_scalar**-0.5 if config.query_pre_attn_scalar else None,
        rotary_dim=config.rotary_dim,
        output_gate=config.attention_output_gate,
        rngs=rngs,
        **kw,
    )


class Block(block.Block):
    """A block with grouped-query attention of `kind`: dense, or with `moe` a mixture-of-experts block
    (models/mixtral.py)."""

    def __init__(self, config: ModelConfig, kind: str = FULL, *, moe: bool = False, rngs: nnx.Rngs, **kw):
        super().__init__(config, attention(config, kind, rngs=rngs, **kw), moe=moe, rngs=rngs, **kw)


class Llama(Decoder):
    """A stack of `num_layers` dense blocks (`block`: (config, kind, rngs=, **dtypes) -> a block) of the config's
    layer kinds between the shared embedding and head (see models/decoder.py)."""

    block = Block

    def __init__(self, config: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        super().__init__(config, compute, rngs=rngs)
        kw = self.dtypes()
        self.layers = make_layers(lambda kind, r: self.block(config, kind, rngs=r, **kw), config.layer_kinds, rngs)

    def blocks(self, x, positions, segment_ids):
        """-> (x, {}): dense blocks report nothing."""
        x, _ = run_layers(self.layers, x, positions, segment_ids, remat_policy=self.compute.remat_policy)
        return x, {}
