"""Hugging Face `Qwen3_5MoeForCausalLM` and the text model of `Qwen3_5MoeForConditionalGeneration` <-> our
`qwen3_5_moe` family (models/qwen3_5.py's Qwen3_5Moe).

The attention, Gated DeltaNet layers and norms are Qwen3.5's (models/hf/qwen3_5.py). Every layer ends in a mixture
of experts: a softmax top-k router (mlp.gate, the chosen weights renormalised), experts stored one per tensor
(mlp.experts.{e}.{gate,up,down}_proj) and one shared expert of shared_expert_intermediate_size
(mlp.shared_expert.*) scaled by sigmoid(mlp.shared_expert_gate). router_aux_loss_coef is the weight of the
load-balancing loss training adds. The ConditionalGeneration checkpoints' vision tower and mtp.* are skipped, each
kind in one log line; exports write a Qwen3_5MoeForCausalLM.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.hf import gqa, qwen3_5
from models.hf.spec import (
    Family,
    Nesting,
    Placement,
    Tensor,
    aux_loss_coef,
    check_fields,
    never,
    placements,
    transpose,
)

ARCHITECTURE = "Qwen3_5MoeForCausalLM"
# Qwen3_5MoeTextConfig's values for the keys a config.json may leave out
DEFAULTS = {
    **qwen3_5.DEFAULTS,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "router_aux_loss_coef": 0.001,
}
# ModelConfig fields the mixture of experts of these architectures holds only with these values
EXPERT_FIELDS = {**gqa.SOFTMAX_EXPERTS, "num_shared_experts": 1, "shared_expert_gate": True}
FIELDS = {**EXPERT_FIELDS, "norm_topk_prob": True, "first_dense_layers": 0}


def expert_fields(hf: dict) -> dict:
    """The ModelConfig fields of a Qwen3.5-MoE / Qwen3-Next config.json's routed and shared experts."""
    return dict(
        EXPERT_FIELDS,
        num_experts=hf["num_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        moe_mlp_dim=hf["moe_intermediate_size"],
        shared_expert_mlp_dim=hf["shared_expert_intermediate_size"],
        router_bias_rate=0.0,
        router_aux_loss_coef=float(hf["router_aux_loss_coef"]),
    )


def expert_keys(config: ModelConfig, architecture: str) -> dict:
    """`expert_fields` undone: the config.json keys of the experts."""
    return {
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "moe_intermediate_size": config.moe_mlp_dim,
        "shared_expert_intermediate_size": config.shared_expert_mlp_dim or config.moe_mlp_dim,
        "router_aux_loss_coef": aux_loss_coef(config, architecture),
    }


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Qwen3_5MoeForCausalLM -> ModelConfig (runtime fields left at their defaults). It has no dense
    MLP: mlp_dim is the experts' width."""
    hf = {**DEFAULTS, **hf}
    hf["intermediate_size"] = hf["moe_intermediate_size"]
    return qwen3_5.text_config_from_hf(
        hf, "qwen3_5_moe", ARCHITECTURE, **expert_fields(hf), norm_topk_prob=True, first_dense_layers=0
    )


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig of the qwen3_5_moe family -> config.json of a Qwen3_5MoeForCausalLM."""
    check_fields(config, FIELDS, ARCHITECTURE)
    hf = qwen3_5.text_config_to_hf(config, ARCHITECTURE, "qwen3_5_moe_text")
    del hf["intermediate_size"]
    return {**hf, **expert_keys(config, ARCHITECTURE)}


def experts(block: Placement) -> list[Tensor]:
    """Router, routed experts (one tensor each), shared expert and its gate of the MoE layers in our `block`."""
    prefix, moe = "model.layers.{layer}.mlp.", (*block.path, "moe")
    return [
        *gqa.experts("mlp", {p: f"{p}_proj" for p in ("gate", "up", "down")}, block),
        *(
            Tensor(prefix + f"shared_expert.{p}_proj.weight", (*moe, "shared", p), transpose, transpose, block.slices)
            for p in ("gate", "up", "down")
        ),
        Tensor(prefix + "shared_expert_gate.weight", (*moe, "shared_gate"), transpose, transpose, block.slices),
    ]


def tensors(config: ModelConfig, mixer=qwen3_5.mixer) -> list[Tensor]:
    """Every tensor of a checkpoint of these layers (`mixer(config, block)`: norms and token mixer): the dense
    layers' MLPs, the MoE layers' experts; lm_head.weight only when embeddings are untied."""

    def stack(name: str, feed_forward) -> list[Tensor]:
        return [t for block in placements(config, name) for t in mixer(config, block) + feed_forward(block)]

    return gqa.checkpoint(config, stack("dense_layers", gqa.mlp) + stack("moe_layers", experts))


FAMILY = Family(
    ARCHITECTURE,
    "qwen3_5_moe",
    config_from_hf,
    config_to_hf,
    tensors,
    zeros=gqa.router_bias,
    nesting=Nesting.multi_token_prediction("qwen3_5_moe"),
)
VL_FAMILY = Family(
    "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe",
    lambda hf: config_from_hf(qwen3_5.text_config(hf)),
    config_to_hf,
    tensors,
    zeros=gqa.router_bias,
    exports=never,
    nesting=Nesting.multi_token_prediction("qwen3_5_moe text", vision=True),
)
