"""The pre-norm block every family is made of: x + attn(attn_norm(x)), then + the feed-forward of mlp_norm(x), a
dense SwiGLU (`mlp`) or a mixture of experts (`moe`). A family gives the attention (models/llama.py: grouped-query;
models/deepseek.py: latent)."""

from __future__ import annotations

from flax import nnx

import parallel
from layers.mlp import SwiGLU
from layers.moe import MoE
from layers.norm import RMSNorm
from models.config import ModelConfig


def experts(config: ModelConfig, *, rngs: nnx.Rngs, **kw) -> MoE:
    """The mixture of experts of `config`: routed experts (and shared ones) with the routing its fields say."""
    return MoE(
        config.embed_dim,
        num_experts=config.num_experts,
        experts_per_token=config.experts_per_token,
        moe_mlp_dim=config.moe_mlp_dim,
        num_shared_experts=config.num_shared_experts,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
        router_score=config.router_score,
        router_logit_bias=config.router_logit_bias,
        expert_mlp=config.expert_mlp,
        swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
        shared_mlp_dim=config.shared_expert_mlp_dim,
        shared_gate=config.shared_expert_gate,
        rngs=rngs,
        **kw,
    )


class Block(nnx.Module):
    """x [batch, length, embed] -> (x, expert stats or None). `attention` is the family's attention module, made
    with the same rngs just before the block ((x, positions, segment_ids) -> [batch, length, embed]); `moe` chooses
    the feed-forward: `moe` = experts(config) and `mlp` None, or `mlp` = SwiGLU(embed_dim, mlp_dim) and `moe` None.
    A family may set `norm_offset` (both norms', layers.norm.RMSNorm)."""

    norm_offset: float = 0.0

    def __init__(self, config: ModelConfig, attention: nnx.Module, *, moe: bool, rngs: nnx.Rngs, **kw):
        norm = dict(eps=config.norm_eps, offset=self.norm_offset, rngs=rngs, **kw)
        self.attn_norm = RMSNorm(config.embed_dim, **norm)
        self.attn = attention
        self.mlp_norm = RMSNorm(config.embed_dim, **norm)
        self.mlp = None if moe else SwiGLU(config.embed_dim, config.mlp_dim, rngs=rngs, **kw)
        self.moe = experts(config, rngs=rngs, **kw) if moe else None

    def __call__(self, x, positions, segment_ids):
        """x: [batch, length, embed], positions/segment_ids: [batch, length] -> (x, None) from a dense block, (x,
        the expert statistics of layers.moe.MoE) from an MoE block."""
        return self.feed_forward(x + self.attn(self.attn_norm(x), positions, segment_ids))

    def feed_forward(self, x):
        """x [batch, length, embed] plus its feed-forward -> (x, None) from a dense SwiGLU, (x, the expert statistics
        of layers.moe.MoE) from experts."""
        if self.moe is None:
            return parallel.residual(x + self.mlp(self.mlp_norm(x))), None
        y, stats = self.moe(self.mlp_norm(x))
        return parallel.residual(x + y), stats
