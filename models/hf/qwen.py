"""Hugging Face `Qwen2ForCausalLM` (Qwen2 / 2.5), `Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` <-> our `qwen2`,
`qwen3` and `qwen3_moe` families, in models/hf/gqa.py's layout.

Qwen2 has q/k/v biases (qkv_bias), Qwen3 and Qwen3-MoE per-head q/k norms (qk_norm). Qwen3-MoE's MoE layers route
with a softmax top-k over `num_experts` experts (weights renormalised if norm_topk_prob), without a shared expert;
layer i is dense when it is in mlp_only_layers or i + 1 is no multiple of decoder_sparse_step, which our model holds
when the dense layers come first (first_dense_layers); other layouts are refused. Sliding windows (use_sliding_window)
as models/hf/window.py reads them. Qwen3-MoE trains with the load-balancing loss of weight router_aux_loss_coef.
"""

from __future__ import annotations

import functools

from models.config import ModelConfig
from models.hf import gqa
from models.hf.spec import Family, Tensor, aux_loss_coef, check_fields
from models.hf.window import every_layer_window, switched_window_to_hf, switched_windowed_layers, window_from_hf

QWEN2, QWEN3, QWEN3_MOE = "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"
ROPE_TYPES = ("default", "yarn")
# config.json keys whose other values our model cannot represent -> the value it needs (written on export)
REQUIRED = {"hidden_act": "silu"}
QWEN3_REQUIRED = {**REQUIRED, "attention_bias": False}  # attention_bias would add o_proj's bias too
# the config classes' values for the keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096, "max_window_layers": 28}
QWEN3_DEFAULTS = {**DEFAULTS, "head_dim": 128}
QWEN3_MOE_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "sliding_window": 4096,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
}
# ModelConfig fields each architecture holds only with these values
QWEN2_FIELDS = {"qkv_bias": True, "qk_norm": False}
QWEN3_FIELDS = {"qkv_bias": False, "qk_norm": True}
QWEN3_MOE_FIELDS = {**QWEN3_FIELDS, **gqa.SOFTMAX_EXPERTS}


def qwen2_config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Qwen2ForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    hf = {**DEFAULTS, **hf}
    window = window_from_hf(hf, switched_windowed_layers(hf))
    return gqa.config_from_hf(hf, "qwen2", QWEN2, REQUIRED, ROPE_TYPES, **QWEN2_FIELDS, **window)


def qwen3_config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Qwen3ForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    hf = {**QWEN3_DEFAULTS, **hf}
    window = window_from_hf(hf, switched_windowed_layers(hf))
    return gqa.config_from_hf(hf, "qwen3", QWEN3, QWEN3_REQUIRED, ROPE_TYPES, **QWEN3_FIELDS, **window)


def first_dense_layers(hf: dict, architecture: str = QWEN3_MOE) -> int:
    """How many layers of a Qwen3-MoE (or Qwen3-Next: `architecture`) config.json are dense, when they come first;
    ValueError naming mlp_only_layers or decoder_sparse_step when dense layers come after an MoE layer."""
    step, only = hf["decoder_sparse_step"], set(hf["mlp_only_layers"])
    dense = [i for i in range(hf["num_hidden_layers"]) if i in only or not hf["num_experts"] or (i + 1) % max(step, 1)]
    if dense != list(range(len(dense))):
        key = "mlp_only_layers" if step == 1 else "decoder_sparse_step"
        raise ValueError(
            f"{architecture}: config.json has {key}={hf[key]!r}, which makes layers {dense} dense; only dense layers "
            f"before all MoE layers are supported (mlp_only_layers=[0, ..., k - 1], decoder_sparse_step=1)"
        )
    return len(dense)


def qwen3_moe_config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Qwen3MoeForCausalLM -> ModelConfig with a softmax router and a frozen (zero) router bias
    (runtime fields left at their defaults). transformers 5 writes num_experts as num_local_experts."""
    hf = {**QWEN3_MOE_DEFAULTS, **hf}
    if "num_local_experts" in hf:
        hf["num_experts"] = hf["num_local_experts"]
    windowed = list(range(hf["num_hidden_layers"])) if hf.get("use_sliding_window") else []
    return gqa.config_from_hf(
        hf,
        "qwen3_moe",
        QWEN3_MOE,
        QWEN3_REQUIRED,
        ROPE_TYPES,
        **QWEN3_FIELDS,
        num_experts=hf["num_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        moe_mlp_dim=hf["moe_intermediate_size"],
        first_dense_layers=first_dense_layers(hf),
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        router_score="softmax",
        router_bias_rate=0.0,
        router_aux_loss_coef=float(hf["router_aux_loss_coef"]),
        **window_from_hf(hf, windowed),
    )


def qwen2_config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig with q/k/v biases -> config.json of a Qwen2ForCausalLM."""
    check_fields(config, QWEN2_FIELDS, QWEN2)
    return {**gqa.config_to_hf(config, QWEN2, "qwen2", ROPE_TYPES), **REQUIRED, **switched_window_to_hf(config)}


def qwen3_config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig with q/k norms -> config.json of a Qwen3ForCausalLM."""
    check_fields(config, QWEN3_FIELDS, QWEN3)
    return {
        **gqa.config_to_hf(config, QWEN3, "qwen3", ROPE_TYPES),
        **QWEN3_REQUIRED,
        **switched_window_to_hf(config),
    }


def qwen3_moe_config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig with q/k norms and a softmax router without shared experts -> config.json of a
    Qwen3MoeForCausalLM (its dense layers first: mlp_only_layers; a window in every layer or none)."""
    check_fields(config, QWEN3_MOE_FIELDS, QWEN3_MOE)
    window = every_layer_window(config, QWEN3_MOE)
    return {
        **gqa.config_to_hf(config, QWEN3_MOE, "qwen3_moe", ROPE_TYPES),
        **QWEN3_REQUIRED,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "moe_intermediate_size": config.moe_mlp_dim,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(config.num_dense_layers)),
        "router_aux_loss_coef": aux_loss_coef(config, QWEN3_MOE),
    }


def dense_tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a Qwen2ForCausalLM / Qwen3ForCausalLM checkpoint (biases or q/k norms as the fields say)."""
    return gqa.checkpoint(config, gqa.layers(config, "layers", gqa.mlp))


def qwen3_moe_tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a Qwen3MoeForCausalLM checkpoint: dense layers' MLPs, MoE layers' router and experts
    (mlp.experts.{e}.{gate,up,down}_proj)."""
    experts = functools.partial(gqa.experts, "mlp", {p: f"{p}_proj" for p in ("gate", "up", "down")})
    return gqa.checkpoint(
        config, gqa.layers(config, "dense_layers", gqa.mlp) + gqa.layers(config, "moe_layers", experts)
    )


QWEN2_FAMILY = Family(QWEN2, "qwen2", qwen2_config_from_hf, qwen2_config_to_hf, dense_tensors)
QWEN3_FAMILY = Family(QWEN3, "qwen3", qwen3_config_from_hf, qwen3_config_to_hf, dense_tensors)
QWEN3_MOE_FAMILY = Family(
    QWEN3_MOE,
    "qwen3_moe",
    qwen3_moe_config_from_hf,
    qwen3_moe_config_to_hf,
    qwen3_moe_tensors,
    zeros=gqa.router_bias,
)
