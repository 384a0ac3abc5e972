"""Hugging Face `MistralForCausalLM` and `MixtralForCausalLM` <-> our `mistral` and `mixtral` families, in
models/hf/gqa.py's layout; `sliding_window` (None: full attention) windows every layer (models/hf/window.py).

Mixtral's every layer is a mixture of `num_local_experts` experts of size intermediate_size (Hugging Face w1 / w3 /
w2 = our gate / up / down), routed by a softmax top-k with the chosen weights renormalised, trained with the
load-balancing loss of weight router_aux_loss_coef. router_jitter_noise (a transformers training setting) is not
applied.
"""

from __future__ import annotations

import functools

from models.config import ModelConfig
from models.hf import gqa
from models.hf.spec import Family, Tensor, aux_loss_coef, check_fields
from models.hf.window import every_layer_window, window_from_hf

MISTRAL, MIXTRAL = "MistralForCausalLM", "MixtralForCausalLM"
ROPE_TYPES = ("default", "yarn")
# config.json keys whose other values our model cannot represent -> the value it needs (written on export)
REQUIRED = {"hidden_act": "silu"}
# the config classes' values for the keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096}
MIXTRAL_DEFAULTS = {
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 1e6,
    "sliding_window": None,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001,
}
# ModelConfig fields each architecture holds only with these values
FIELDS = {"qkv_bias": False, "qk_norm": False}
MIXTRAL_FIELDS = {**FIELDS, **gqa.SOFTMAX_EXPERTS, "norm_topk_prob": True, "first_dense_layers": 0}
MIXTRAL_EXPERTS = {"gate": "w1", "up": "w3", "down": "w2"}  # our expert matrix -> Mixtral's name


def mistral_config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a MistralForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    hf = {**DEFAULTS, **hf}
    window = window_from_hf(hf, list(range(hf["num_hidden_layers"])))
    return gqa.config_from_hf(hf, "mistral", MISTRAL, REQUIRED, ROPE_TYPES, **window)


def mixtral_config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a MixtralForCausalLM -> ModelConfig with a softmax router and a frozen (zero) router bias
    (runtime fields left at their defaults)."""
    hf = {**MIXTRAL_DEFAULTS, **hf}
    return gqa.config_from_hf(
        hf,
        "mixtral",
        MIXTRAL,
        REQUIRED,
        ROPE_TYPES,
        num_experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        moe_mlp_dim=hf["intermediate_size"],
        router_score="softmax",
        router_bias_rate=0.0,
        router_aux_loss_coef=float(hf["router_aux_loss_coef"]),
        **window_from_hf(hf, list(range(hf["num_hidden_layers"]))),
    )


def mistral_config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig (a window in every layer or none) -> config.json of a MistralForCausalLM."""
    check_fields(config, FIELDS, MISTRAL)
    window = every_layer_window(config, MISTRAL)
    return {**gqa.config_to_hf(config, MISTRAL, "mistral", ROPE_TYPES), **REQUIRED, "sliding_window": window}


def mixtral_config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig of MoE layers only, routed by a renormalised softmax top-k, a window in every layer or none ->
    config.json of a MixtralForCausalLM (intermediate_size: the experts' moe_mlp_dim)."""
    check_fields(config, MIXTRAL_FIELDS, MIXTRAL)
    window = every_layer_window(config, MIXTRAL)
    return {
        **gqa.config_to_hf(config, MIXTRAL, "mixtral", ROPE_TYPES),
        **REQUIRED,
        "sliding_window": window,
        "intermediate_size": config.moe_mlp_dim,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "router_aux_loss_coef": aux_loss_coef(config, MIXTRAL),
    }


def mistral_tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a MistralForCausalLM checkpoint; lm_head.weight only when embeddings are untied."""
    return gqa.checkpoint(config, gqa.layers(config, "layers", gqa.mlp))


def mixtral_tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a MixtralForCausalLM checkpoint: attention, router (block_sparse_moe.gate) and experts
    (block_sparse_moe.experts.{e}.w1 / w3 / w2) of each layer."""
    experts = functools.partial(gqa.experts, "block_sparse_moe", MIXTRAL_EXPERTS)
    return gqa.checkpoint(config, gqa.layers(config, "moe_layers", experts))


MISTRAL_FAMILY = Family(MISTRAL, "mistral", mistral_config_from_hf, mistral_config_to_hf, mistral_tensors)
MIXTRAL_FAMILY = Family(
    MIXTRAL, "mixtral", mixtral_config_from_hf, mixtral_config_to_hf, mixtral_tensors, zeros=gqa.router_bias
)
