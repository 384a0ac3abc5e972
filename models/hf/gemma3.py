"""Hugging Face `Gemma3ForCausalLM` (Gemma 3 text) <-> our `gemma3` family (models/gemma3.py).

Each layer has q/k norms and four norms (input / post_attention / pre_feedforward / post_feedforward layernorm, ours
attn_norm / post_attn_norm / mlp_norm / post_mlp_norm), all Gemma's 1 + weight with the weight stored as ours. Layer
types (sliding_attention within sliding_window, full_attention) come from layer_types, else sliding_window_pattern
(every sixth layer full). Full layers rotate with rope_theta and rope_scaling, sliding ones with rope_local_base_freq
unscaled (transformers 5 writes both as rope_parameters by layer type, which is read too); query_pre_attn_scalar sets
the softmax scale. Logit soft-capping (Gemma 2's; Gemma 3 has none), attention biases and bidirectional attention
are refused.
"""

from __future__ import annotations

from models.config import FULL, SLIDING, ModelConfig
from models.hf import gqa
from models.hf.rope import rope_from_hf
from models.hf.spec import Family, Placement, Tensor, check_fields, placements
from models.hf.window import window_from_hf

ARCHITECTURE = "Gemma3ForCausalLM"
ROPE_TYPES = ("default", "linear")
# config.json keys whose other values our model cannot represent -> the value it needs (written on export)
REQUIRED = {
    "hidden_activation": "gelu_pytorch_tanh",
    "attention_bias": False,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
}
# Gemma3TextConfig's values for the keys a config.json may leave out (the 4B's text_config names only its sizes)
DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
    "max_position_embeddings": 131072,
}
# ModelConfig fields a Gemma3ForCausalLM holds only with these values
FIELDS = {"qkv_bias": False, "qk_norm": True}
NORMS = {  # Hugging Face's layer norm -> ours
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
}


def layer_types(hf: dict) -> tuple[str, ...]:
    """Each layer's attention: layer_types, else every sliding_window_pattern-th layer full, the others sliding."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    pattern = hf["sliding_window_pattern"]
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(hf["num_hidden_layers"]))


def ropes(hf: dict) -> dict:
    """{rope_theta, rope_scaling} of the full layers and local_rope_theta of the sliding ones, from either form."""
    by_type = hf.get("rope_parameters") or {}
    if FULL in by_type:
        full, local = {"rope_parameters": by_type[FULL]}, {"rope_parameters": by_type[SLIDING]}
    else:
        full, local = hf, {"rope_theta": hf["rope_local_base_freq"]}
    local_rope = rope_from_hf(local, ARCHITECTURE, ("default",))  # the sliding layers' rope is never scaled
    return {**rope_from_hf(full, ARCHITECTURE, ROPE_TYPES), "local_rope_theta": local_rope["rope_theta"]}


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Gemma3ForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    hf = {**DEFAULTS, **hf}
    kinds = layer_types(hf)
    window = window_from_hf(hf, [layer for layer, kind in enumerate(kinds) if kind == SLIDING])
    return gqa.config_from_hf(
        hf,
        "gemma3",
        ARCHITECTURE,
        REQUIRED,
        None,
        **FIELDS,
        **ropes(hf),
        **window,
        query_pre_attn_scalar=int(hf["query_pre_attn_scalar"]),
        max_position_embeddings=hf["max_position_embeddings"],
    )


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig with q/k norms and a local rope -> config.json of a Gemma3ForCausalLM (layer_types written out;
    a sliding_window that no layer uses is Gemma3TextConfig's default)."""
    check_fields(config, FIELDS, ARCHITECTURE)
    if not config.local_rope_theta:
        raise ValueError(
            f"{ARCHITECTURE} cannot hold model.local_rope_theta=0 (sliding layers rotating as full ones); it needs "
            f"the sliding layers' rope theta (rope_local_base_freq, > 0)"
        )
    hf = gqa.config_to_hf(config, ARCHITECTURE, "gemma3_text", ROPE_TYPES)
    return {
        **hf,
        **REQUIRED,
        "rope_local_base_freq": config.local_rope_theta,
        "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
        "sliding_window": config.sliding_window or DEFAULTS["sliding_window"],
        "layer_types": list(config.layer_kinds),
        "max_position_embeddings": config.max_position_embeddings or hf["max_position_embeddings"],
    }


def layer(config: ModelConfig, block: Placement) -> list[Tensor]:
    """The four norms, attention and gated MLP of the layers in our stacked `block`."""
    return [*gqa.norms(block, NORMS), *gqa.projections(config, block), *gqa.mlp(block)]


def tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a Gemma3ForCausalLM checkpoint; lm_head.weight only when embeddings are untied."""
    return gqa.checkpoint(config, [tensor for block in placements(config, "layers") for tensor in layer(config, block)])


FAMILY = Family(ARCHITECTURE, "gemma3", config_from_hf, config_to_hf, tensors)
