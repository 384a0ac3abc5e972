"""A decoder with mixture-of-experts blocks: the first `num_dense_layers` blocks end in a dense SwiGLU, the other
`num_moe_layers` in a mixture of experts (all dense when `num_experts` is 0), as two scanned stacks of the
config's layer kinds (models/stack.py).

Expert loads and router probabilities come back from `hidden` as aux, per layer and row: `aux_losses` turns them into
the load-balancing loss (`router_aux_loss_coef`, over the tokens `router_aux_loss_scope` names), `balance` into the
aux-loss-free router-bias update and the load metrics after each optimizer step. A family (models/deepseek.py,
models/mixtral.py) names its block class.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from layers.moe import load_balancing_loss, load_imbalance, update_router_bias
from models.config import ComputeConfig, ModelConfig
from models.decoder import Decoder
from models.stack import make_layers, run_layers, stacked_blocks

# the names of layers.moe.MoE's statistics in a decoder's aux
EXPERT_STATISTICS = {"counts": "expert_counts", "dropped": "expert_dropped", "probabilities": "expert_probabilities"}


class MixtureDecoder(Decoder):
    """`dense_layers` then `moe_layers` (each None when empty) between the shared embedding and head.

    `block` is the family's block class: block(config, kind, moe=..., rngs=..., param_dtype=..., dtype=...)."""

    block: type[nnx.Module]

    def __init__(self, config: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        super().__init__(config, compute, rngs=rngs)
        kw, kinds, dense = self.dtypes(), config.layer_kinds, config.num_dense_layers
        self.dense_layers = (
            make_layers(lambda kind, r: self.block(config, kind, moe=False, rngs=r, **kw), kinds[:dense], rngs)
            if dense
            else None
        )
        self.moe_layers = (
            make_layers(lambda kind, r: self.block(config, kind, moe=True, rngs=r, **kw), kinds[dense:], rngs)
            if config.num_moe_layers
            else None
        )

    def blocks(self, x, positions, segment_ids):
        """-> (x, aux {"expert_counts": [moe layers, batch, experts], "expert_dropped": [moe layers],
        "expert_probabilities": [moe layers, batch, experts]} float32, summed over each row's tokens (counts,
        probabilities) or every token (dropped); empty without MoE layers; and what else the blocks report, on a
        leading axis of the layers reporting it)."""
        policy, reports = self.compute.remat_policy, []
        for layers in (self.dense_layers, self.moe_layers):
            if layers is not None:
                x, report = run_layers(layers, x, positions, segment_ids, remat_policy=policy)
                reports.append(report or {})
        names = sorted({name for report in reports for name in report})
        aux = {name: jnp.concatenate([report[name] for report in reports if name in report]) for name in names}
        return x, {EXPERT_STATISTICS.get(name, name): value for name, value in aux.items()}

    def aux_losses(self, aux) -> dict:
        """{"router_aux_loss": (router_aux_loss_coef, the load-balancing loss [] over router_aux_loss_scope's tokens)}
        when the coefficient is set and there are MoE layers, else {}."""
        config = self.config
        if self.moe_layers is None or not config.router_aux_loss_coef:
            return {}
        counts = jax.lax.stop_gradient(aux["expert_counts"])
        loss = load_balancing_loss(
            counts, aux["expert_probabilities"], config.experts_per_token, config.router_aux_loss_scope
        )
        return {"router_aux_loss": (config.router_aux_loss_coef, loss)}

    def balance(self, aux) -> dict:
        """After an optimizer step: moves each MoE layer's router bias towards equal expert loads (rate
        `router_bias_rate`; 0 for softmax routing, whose bias stays zero) and returns the load metrics (imbalance =
        max / mean expert load, worst layer) and the fraction of assignments dropped by the expert dispatch (all MoE
        layers)."""
        if self.moe_layers is None:
            return {}
        counts = jax.lax.stop_gradient(aux["expert_counts"]).sum(1)  # [moe layers, experts]
        rate = self.config.router_bias_rate
        for block, layers in stacked_blocks(self.moe_layers, self.config.layer_kinds[self.config.num_dense_layers :]):
            bias = block.moe.bias
            bias[...] = jax.vmap(update_router_bias, in_axes=(0, 0, None))(bias[...], counts[jnp.asarray(layers)], rate)
        imbalance = jax.vmap(load_imbalance)(counts)
        dropped = jnp.sum(aux["expert_dropped"]) / jnp.maximum(jnp.sum(counts), 1.0)
        return {
            "expert_imbalance": jnp.max(imbalance),
            "expert_imbalance_mean": jnp.mean(imbalance),
            "expert_dropped": dropped,
        }
