"""Hugging Face `Qwen3_5ForCausalLM` and the text model of `Qwen3_5ForConditionalGeneration` <-> our `qwen3_5`
family (models/qwen3_5.py).

Layers are linear_attention (Gated DeltaNet, `linear_attn.*`) or full_attention (`self_attn.*`) as layer_types says,
else every full_attention_interval-th layer (4) full. Full attention: q_proj's rows hold each head's query then its
gate (ours q and gate), q/k norms of 1 + weight, rope on partial_rotary_factor of each head (rope_parameters; 0.25
when left out; the multimodal sections reduce to the plain rope for text). Gated DeltaNet: in_proj_qkv's rows are
[q | k | v] and conv1d's channels alike (ours q, k, v and conv_q, conv_k, conv_v), in_proj_z / in_proj_b /
in_proj_a, A_log (ours a_log), dt_bias, norm (ours norm_scale) and out_proj. Every decoder norm is 1 + weight, the
weight stored as ours. The ConditionalGeneration checkpoints' vision tower and multi-token-prediction layers (mtp.*)
are skipped, each kind in one log line; exports write a Qwen3_5ForCausalLM.
"""

from __future__ import annotations

import numpy as np

from models.config import FULL, LINEAR, ModelConfig
from models.hf import gqa
from models.hf.rope import DEFAULT_THETA, rope_from_hf
from models.hf.spec import (
    Family,
    Nesting,
    Placement,
    Tensor,
    check_fields,
    heads_in_to_hf,
    heads_out_to_hf,
    never,
    placements,
    transpose,
)

ARCHITECTURE = "Qwen3_5ForCausalLM"
ROPE_TYPES = ("default", "yarn")  # yarn: what a 128K fine-tune extends the rope with (models/config.py)
# config.json keys whose other values our model cannot represent -> the value it needs (written on export)
REQUIRED = {"hidden_act": "silu", "attention_bias": False}
# Qwen3_5TextConfig's values for the keys a config.json may leave out
DEFAULTS = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "full_attention_interval": 4,
}
PARTIAL_ROTARY = 0.25  # Qwen3_5TextConfig's partial_rotary_factor when config.json leaves it out
# ModelConfig fields a Qwen3_5ForCausalLM holds only with these values
FIELDS = {"qkv_bias": False, "qk_norm": True, "attention_output_gate": True, "sliding_window": 0}
LINEAR_KEYS = {  # our field -> config.json key
    "linear_key_heads": "linear_num_key_heads",
    "linear_heads": "linear_num_value_heads",
    "linear_key_dim": "linear_key_head_dim",
    "linear_value_dim": "linear_value_head_dim",
    "linear_conv_taps": "linear_conv_kernel_dim",
}
NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}


def layer_types(hf: dict) -> tuple[str, ...]:
    """Each layer's kind: layer_types, else every full_attention_interval-th layer full, the others linear."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    interval = hf["full_attention_interval"]
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(hf["num_hidden_layers"]))


def text_config_from_hf(hf: dict, family: str, architecture: str, **fields) -> ModelConfig:
    """config.json of a Qwen3.5-like text model, its left-out keys filled -> ModelConfig of `family` with its
    attention, rope, layer kinds and linear layers; `fields` are the rest (the feed-forward's)."""
    params = dict(hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", DEFAULT_THETA)})
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", PARTIAL_ROTARY))
    for key in ("mrope_section", "mrope_interleaved"):  # the multimodal rope's; one plain rope for text
        params.pop(key, None)
    return gqa.config_from_hf(
        hf,
        family,
        architecture,
        REQUIRED,
        None,
        **FIELDS,
        **rope_from_hf({**hf, "rope_parameters": params}, architecture, ROPE_TYPES),
        partial_rotary_factor=float(partial),
        layer_types=layer_types(hf),
        max_position_embeddings=hf["max_position_embeddings"],
        **{ours: int(hf[key]) for ours, key in LINEAR_KEYS.items()},
        **fields,
    )


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Qwen3_5ForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    return text_config_from_hf({**DEFAULTS, **hf}, "qwen3_5", ARCHITECTURE)


def text_config_to_hf(config: ModelConfig, architecture: str, model_type: str) -> dict:
    """ModelConfig of a Qwen3.5-like family -> config.json of `architecture` (layer_types and rope_parameters
    written out; the feed-forward's keys are the caller's)."""
    check_fields(config, FIELDS, architecture)
    hf = gqa.config_to_hf(config, architecture, model_type, ROPE_TYPES)
    rope = {
        **(hf.pop("rope_scaling") or {"rope_type": "default"}),
        "rope_theta": hf.pop("rope_theta"),
        "partial_rotary_factor": config.partial_rotary_factor,
    }
    return {
        **hf,
        **REQUIRED,
        "rope_parameters": rope,
        "layer_types": list(config.layer_kinds),
        **{key: getattr(config, ours) for ours, key in LINEAR_KEYS.items()},
    }


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig of the qwen3_5 family -> config.json of a Qwen3_5ForCausalLM."""
    return text_config_to_hf(config, ARCHITECTURE, "qwen3_5_text")


def _kind(config: ModelConfig, block: Placement) -> str:
    """The layer kind of the layers in our stacked `block` (alike by construction)."""
    return config.layer_kinds[block.layers[0]]


def _query_gate_in(weight: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """q_proj weight [heads * 2 * head_dim, embed] (each head's query, then its gate) -> (q, gate) kernels [embed,
    heads, head_dim]."""
    both = weight.T.reshape(weight.shape[1], config.num_heads, 2, config.head_dim)
    return both[:, :, 0], both[:, :, 1]


def _query_gate_out(parts: tuple[np.ndarray, np.ndarray], config: ModelConfig) -> np.ndarray:
    """(q, gate) kernels [embed, heads, head_dim] -> q_proj weight [heads * 2 * head_dim, embed]."""
    del config
    q, gate = parts
    return np.stack([q, gate], axis=2).reshape(q.shape[0], -1).T


def _linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(heads, head dim) of q, k and v in a linear_attention layer, in in_proj_qkv's order."""
    keys = (config.linear_key_heads, config.linear_key_dim)
    return [keys, keys, (config.linear_heads, config.linear_value_dim)]


def _split_channels(columns: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, ...]:
    """[n, channels] with channels [q | k | v] (in_proj_qkv's rows, conv1d's channels) -> q, k, v [n, heads, dim]."""
    shapes = _linear_shapes(config)
    parts = np.split(columns, np.cumsum([h * d for h, d in shapes])[:-1], axis=1)
    return tuple(p.reshape(p.shape[0], h, d) for p, (h, d) in zip(parts, shapes, strict=True))


def _join_channels(parts: tuple[np.ndarray, ...]) -> np.ndarray:
    """q, k, v [n, heads, dim] -> [n, channels]: `_split_channels` undone."""
    return np.concatenate([p.reshape(p.shape[0], -1) for p in parts], axis=1)


def _qkv_in(weight: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, ...]:
    """in_proj_qkv weight [(2 key heads * key dim + heads * value dim), embed] -> q, k, v kernels [embed, heads,
    dim]."""
    return _split_channels(weight.T, config)


def _qkv_out(parts: tuple[np.ndarray, ...], config: ModelConfig) -> np.ndarray:
    """q, k, v kernels [embed, heads, dim] -> in_proj_qkv weight."""
    del config
    return _join_channels(parts).T


def _conv_in(weight: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, ...]:
    """conv1d weight [channels, 1, taps] (channels [q | k | v]) -> conv_q, conv_k, conv_v [taps, heads, dim]."""
    return _split_channels(weight[:, 0, :].T, config)


def _conv_out(parts: tuple[np.ndarray, ...], config: ModelConfig) -> np.ndarray:
    """conv_q, conv_k, conv_v [taps, heads, dim] -> conv1d weight [channels, 1, taps]."""
    del config
    return _join_channels(parts).T[:, None, :]


def _values_in(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """in_proj_z weight [heads * value dim, embed] -> kernel [embed, heads, value dim]."""
    return weight.T.reshape(weight.shape[1], config.linear_heads, config.linear_value_dim)


def _out_in(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """out_proj weight [embed, heads * value dim] -> kernel [heads, value dim, embed]."""
    return weight.T.reshape(config.linear_heads, config.linear_value_dim, weight.shape[0])


def full_attention(config: ModelConfig, block: Placement) -> list[Tensor]:
    """The gated grouped-query attention (self_attn.*) of the layers in our stacked `block`."""
    attn, ours, slices = "model.layers.{layer}.self_attn.", (*block.path, "attn"), block.slices
    return [
        Tensor(attn + "q_proj.weight", ((*ours, "q"), (*ours, "gate")), _query_gate_in, _query_gate_out, slices),
        *(t for t in gqa.projections(config, block) if not t.hf.endswith("q_proj.weight")),
    ]


def linear_attention(block: Placement) -> list[Tensor]:
    """Gated DeltaNet (linear_attn.*) of the layers in our stacked `block`."""
    attn, ours, slices = "model.layers.{layer}.linear_attn.", (*block.path, "attn"), block.slices
    return [
        Tensor(attn + "in_proj_qkv.weight", tuple((*ours, p) for p in "qkv"), _qkv_in, _qkv_out, slices),
        Tensor(attn + "in_proj_z.weight", (*ours, "z"), _values_in, heads_in_to_hf, slices),
        Tensor(attn + "in_proj_b.weight", (*ours, "b"), transpose, transpose, slices),
        Tensor(attn + "in_proj_a.weight", (*ours, "a"), transpose, transpose, slices),
        Tensor(attn + "conv1d.weight", tuple((*ours, f"conv_{p}") for p in "qkv"), _conv_in, _conv_out, slices),
        Tensor(attn + "A_log", (*ours, "a_log"), slices=slices),
        Tensor(attn + "dt_bias", (*ours, "dt_bias"), slices=slices),
        Tensor(attn + "norm.weight", (*ours, "norm_scale"), slices=slices),
        Tensor(attn + "out_proj.weight", (*ours, "out"), _out_in, heads_out_to_hf, slices),
    ]


def mixer(config: ModelConfig, block: Placement) -> list[Tensor]:
    """The norms and token mixer of the layers in our stacked `block`: Gated DeltaNet or the gated attention."""
    mixer = linear_attention(block) if _kind(config, block) == LINEAR else full_attention(config, block)
    return [*gqa.norms(block, NORMS), *mixer]


def tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a Qwen3_5ForCausalLM checkpoint; lm_head.weight only when embeddings are untied."""
    return gqa.checkpoint(
        config, [tensor for block in placements(config, "layers") for tensor in mixer(config, block) + gqa.mlp(block)]
    )


FAMILY = Family(
    ARCHITECTURE, "qwen3_5", config_from_hf, config_to_hf, tensors, nesting=Nesting.multi_token_prediction("qwen3_5")
)

VL_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"


def text_config(hf: dict) -> dict:
    """config.json of a Qwen3.5 ConditionalGeneration -> its text model's (text_config; the top-level
    tie_word_embeddings, which the model reads, over the text config's)."""
    text = dict(hf.get("text_config") or {})
    if "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def vl_config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Qwen3_5ForConditionalGeneration -> the ModelConfig of its text model."""
    return config_from_hf(text_config(hf))


VL_FAMILY = Family(
    VL_ARCHITECTURE,
    "qwen3_5",
    vl_config_from_hf,
    config_to_hf,
    tensors,
    exports=never,
    nesting=Nesting.multi_token_prediction("qwen3_5 text", vision=True),
)
