"""Hugging Face `LlamaForCausalLM` <-> our `llama` family (Llama 2 / 3 / 3.1 / 3.2).

Hugging Face keeps q/k projections in the rotate-half layout (its conversion from Meta's checkpoints permutes
them), which is `layers.rope.apply_rope`'s default, so projections are only transposed and reshaped.
"""

from __future__ import annotations

import numpy as np

from models.config import ModelConfig
from models.hf.rope import rope_from_hf, rope_to_hf
from models.hf.spec import Family, Tensor, check_required, heads_in_to_hf, heads_out_to_hf, per_layer, transpose

ARCHITECTURE = "LlamaForCausalLM"
ROPE_TYPES = ("default", "llama3")
# config.json keys whose other values our model cannot represent -> the value it needs
REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a LlamaForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    check_required(hf, REQUIRED, f"{ARCHITECTURE}: config.json has")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        family="llama",
        vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        mlp_dim=hf["intermediate_size"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **rope_from_hf(hf, ARCHITECTURE, ROPE_TYPES),
    )


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig -> config.json of a LlamaForCausalLM. max_position_embeddings (unused by our model) is the
    rope scaling's factor x original_max_position_embeddings (8192 without scaling)."""
    rope = config.rope_scaling
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "intermediate_size": config.mlp_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": int(rope.factor * rope.original_max_position_embeddings),
        **REQUIRED,
        **rope_to_hf(config, ARCHITECTURE, ROPE_TYPES),
    }


def heads_in(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """q/k/v_proj weight [heads * head_dim, embed] -> kernel [embed, heads, head_dim]."""
    return weight.T.reshape(weight.shape[1], -1, config.head_dim)


def heads_out(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """o_proj weight [embed, heads * head_dim] -> kernel [heads, head_dim, embed]."""
    return weight.T.reshape(-1, config.head_dim, weight.shape[0])


def tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a LlamaForCausalLM checkpoint; lm_head.weight only when embeddings are untied."""
    layer = "model.layers.{layer}."
    table = [
        Tensor("model.embed_tokens.weight", ("embed", "embedding")),
        Tensor(layer + "input_layernorm.weight", ("layers", "attn_norm", "scale"), slices=per_layer),
        *(
            Tensor(
                layer + f"self_attn.{name}_proj.weight", ("layers", "attn", name), heads_in, heads_in_to_hf, per_layer
            )
            for name in ("q", "k", "v")
        ),
        Tensor(layer + "self_attn.o_proj.weight", ("layers", "attn", "o"), heads_out, heads_out_to_hf, per_layer),
        Tensor(layer + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), slices=per_layer),
        *(
            Tensor(layer + f"mlp.{name}_proj.weight", ("layers", "mlp", name), transpose, transpose, per_layer)
            for name in ("gate", "up", "down")
        ),
        Tensor("model.norm.weight", ("final_norm", "scale")),
    ]
    if not config.tie_embeddings:
        table.append(Tensor("lm_head.weight", ("head", "kernel"), transpose, transpose))
    return table


FAMILY = Family(ARCHITECTURE, "llama", config_from_hf, config_to_hf, tensors)
