"""Hugging Face `GptOssForCausalLM` <-> our `gpt_oss` family: grouped-query attention with q/k/v/o biases
(attention_bias) and sinks, sliding (sliding_window) or full by layer_types, and in every layer a mixture of
num_local_experts experts.

The router's weight and bias give logits whose top-k softmax weights the chosen experts (ours: the softmax over all,
renormalised over the top k, the same). The experts' gate_up_proj [experts, hidden, 2 x intermediate] (gate and up
interleaved), down_proj [experts, intermediate, hidden] and their biases are our parameters as they are; they run
the clamped SwiGLU (swiglu_alpha, swiglu_limit). YaRN rope with truncate false. OpenAI's checkpoints store the
experts in MXFP4 (quantization_config quant_method mxfp4: `*_blocks` and `*_scales`), read dequantized
(models/hf/stored.py); export writes them unquantized. Training adds the load-balancing loss of weight
router_aux_loss_coef.
"""

from __future__ import annotations

from models.config import FULL, SLIDING, ModelConfig
from models.hf import gqa
from models.hf.spec import (
    Family,
    Placement,
    Tensor,
    aux_loss_coef,
    check_fields,
    placements,
    transpose,
)
from models.hf.window import window_from_hf

GPT_OSS = "GptOssForCausalLM"
ROPE_TYPES = ("default", "yarn")
# GptOssConfig's values for the keys a config.json may leave out
DEFAULTS = {
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 150000.0,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "router_aux_loss_coef": 0.001,
}
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
QUANTIZATION = "mxfp4"  # the quant_method whose tensors are read dequantized
# ModelConfig fields a GptOssForCausalLM holds only with these values
FIELDS = {
    "qk_norm": False,
    "attention_sinks": True,
    **gqa.SOFTMAX_EXPERTS,
    "norm_topk_prob": True,
    "first_dense_layers": 0,
    "router_logit_bias": True,
    "expert_mlp": "clamped_swiglu",
}
# Hugging Face mlp.experts tensor -> our MoE parameter
EXPERTS = {
    "gate_up_proj": "experts_gate_up",
    "gate_up_proj_bias": "experts_gate_up_bias",
    "down_proj": "experts_down",
    "down_proj_bias": "experts_down_bias",
}


def layer_types(hf: dict) -> list[str]:
    """Each layer's attention: layer_types, else GptOssConfig's alternation (sliding first)."""
    return hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(hf["num_hidden_layers"])]


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a GptOssForCausalLM -> ModelConfig (runtime fields left at their defaults); ValueError for a
    quantization other than mxfp4."""
    hf = {**DEFAULTS, **hf}
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf["rope_scaling"] = DEFAULT_ROPE
    quantization = hf.pop("quantization_config", None) or {}
    if quantization and quantization.get("quant_method") != QUANTIZATION:
        raise ValueError(
            f"{GPT_OSS}: config.json has quantization_config {quantization.get('quant_method', '')!r}; only "
            f"{QUANTIZATION} (OpenAI's release, dequantized on import) and unquantized checkpoints are supported"
        )
    windowed = [i for i, kind in enumerate(layer_types(hf)) if kind == SLIDING]
    bias = bool(hf["attention_bias"])
    return gqa.config_from_hf(
        hf,
        "gpt_oss",
        GPT_OSS,
        {},
        ROPE_TYPES,
        **FIELDS,
        qkv_bias=bias,
        o_bias=bias,
        num_experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        moe_mlp_dim=hf["intermediate_size"],
        swiglu_alpha=float(hf["swiglu_alpha"]),
        swiglu_limit=float(hf["swiglu_limit"]),
        router_bias_rate=0.0,
        router_aux_loss_coef=float(hf["router_aux_loss_coef"]),
        **window_from_hf(hf, windowed),
    )


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig of GPT-OSS's features -> config.json of a GptOssForCausalLM (intermediate_size: the experts'
    moe_mlp_dim; attention_bias: q/k/v and o biases, which it holds only together)."""
    check_fields(config, {**FIELDS, "o_bias": config.qkv_bias}, GPT_OSS)
    return {
        **gqa.config_to_hf(config, GPT_OSS, "gpt_oss", ROPE_TYPES),
        "intermediate_size": config.moe_mlp_dim,
        "attention_bias": config.qkv_bias,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
        "router_aux_loss_coef": aux_loss_coef(config, GPT_OSS),
        "sliding_window": config.sliding_window or None,
        "layer_types": list(config.layer_kinds),
    }


def attention(config: ModelConfig, block: Placement) -> list[Tensor]:
    """gqa.attention's tensors of `block`, the o_proj bias (with attention_bias) and the sinks."""
    attn, ours = "model.layers.{layer}.self_attn.", (*block.path, "attn")
    table = gqa.attention(config, block)
    if config.o_bias:
        table.append(Tensor(attn + "o_proj.bias", (*ours, "o_bias", "bias"), slices=block.slices))
    return [*table, Tensor(attn + "sinks", (*ours, "sinks"), slices=block.slices)]


def experts(block: Placement) -> list[Tensor]:
    """The router (mlp.router.weight, .bias) and the experts (mlp.experts.*) of `block`."""
    prefix, moe = "model.layers.{layer}.mlp.", (*block.path, "moe")
    return [
        Tensor(prefix + "router.weight", (*moe, "router"), transpose, transpose, block.slices),
        Tensor(prefix + "router.bias", (*moe, "router_bias"), slices=block.slices),
        *(Tensor(prefix + f"experts.{name}", (*moe, ours), slices=block.slices) for name, ours in EXPERTS.items()),
    ]


def tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a GptOssForCausalLM checkpoint (unquantized)."""
    blocks = placements(config, "moe_layers")
    return gqa.checkpoint(config, [t for block in blocks for t in attention(config, block) + experts(block)])


FAMILY = Family(GPT_OSS, "gpt_oss", config_from_hf, config_to_hf, tensors, zeros=gqa.router_bias)
