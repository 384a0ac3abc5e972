"""DeepSeek-V2/V3-like decoder: multi-head latent attention in every block; the first `first_dense_layers`
blocks end in a dense SwiGLU, the others in a mixture of experts (all dense when `num_experts` is 0).

Two scanned stacks (dense, then MoE). Expert loads come back from `hidden` as aux; `balance` turns them into
the aux-loss-free router-bias update and the load metrics after each optimizer step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import parallel
from layers.mla import MLA
from layers.mlp import SwiGLU
from layers.moe import MoE, load_imbalance, update_router_bias
from layers.norm import RMSNorm
from models.config import ComputeConfig, ModelConfig
from models.decoder import Decoder
from models.stack import make_stack, run_stack


class Block(nnx.Module):
    """x + mla(norm(x)), then + (moe or mlp)(norm(x)); x: [batch, length, embed]."""

    def __init__(self, config: ModelConfig, *, moe: bool, rngs: nnx.Rngs, **kw):
        self.attn_norm = RMSNorm(config.embed_dim, eps=config.norm_eps, rngs=rngs, **kw)
        self.attn = MLA(
            config.embed_dim,
            config.num_heads,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            rope_theta=config.rope_theta,
            rope_scaling=config.rope_scaling,
            rngs=rngs,
            **kw,
        )
        self.mlp_norm = RMSNorm(config.embed_dim, eps=config.norm_eps, rngs=rngs, **kw)
        if moe:
            self.mlp = MoE(
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
                rngs=rngs,
                **kw,
            )
        else:
            self.mlp = SwiGLU(config.embed_dim, config.mlp_dim, rngs=rngs, **kw)
        self.moe = moe

    def __call__(self, x, positions, segment_ids):
        """-> (x, for an MoE block {"counts": assignments per expert [experts], "dropped": []} float32, else None)."""
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        y = self.mlp(self.mlp_norm(x))
        y, stats = y if self.moe else (y, None)
        return parallel.residual(x + y), stats


class DeepSeek(Decoder):
    """`num_dense_layers` dense blocks, then `num_moe_layers` MoE blocks, between the shared embedding and head."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        super().__init__(config, compute, rngs=rngs)
        kw = self.dtypes()
        self.dense_layers = (
            make_stack(lambda r: Block(config, moe=False, rngs=r, **kw), config.num_dense_layers, rngs)
            if config.num_dense_layers
            else None
        )
        self.moe_layers = (
            make_stack(lambda r: Block(config, moe=True, rngs=r, **kw), config.num_moe_layers, rngs)
            if config.num_moe_layers
            else None
        )

    def blocks(self, x, positions, segment_ids):
        """-> (x, aux {"expert_counts": [moe layers, experts], "expert_dropped": [moe layers]} float32, empty
        without MoE layers)."""
        aux = {}
        policy = self.compute.remat_policy
        if self.dense_layers is not None:
            x, _ = run_stack(self.dense_layers, x, positions, segment_ids, remat_policy=policy)
        if self.moe_layers is not None:
            x, stats = run_stack(self.moe_layers, x, positions, segment_ids, remat_policy=policy)
            aux = {"expert_counts": stats["counts"], "expert_dropped": stats["dropped"]}
        return x, aux

    def balance(self, aux) -> dict:
        """After an optimizer step: moves each MoE layer's router bias towards equal expert loads (rate
        `router_bias_rate`) and returns the load metrics (imbalance = max / mean expert load, worst layer) and the
        fraction of assignments dropped by the expert dispatch (all MoE layers)."""
        if self.moe_layers is None:
            return {}
        counts = jax.lax.stop_gradient(aux["expert_counts"])
        bias = self.moe_layers.mlp.bias
        bias[...] = jax.vmap(update_router_bias, in_axes=(0, 0, None))(bias[...], counts, self.config.router_bias_rate)
        imbalance = jax.vmap(load_imbalance)(counts)
        dropped = jnp.sum(aux["expert_dropped"]) / jnp.maximum(jnp.sum(counts), 1.0)
        return {
            "expert_imbalance": jnp.max(imbalance),
            "expert_imbalance_mean": jnp.mean(imbalance),
            "expert_dropped": dropped,
        }
