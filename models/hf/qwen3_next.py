"""Hugging Face `Qwen3NextForCausalLM` <-> our `qwen3_next` family (models/qwen3_5.py's Qwen3_5Moe: the model is
Qwen3.5-MoE's, with dense layers first where mlp_only_layers / decoder_sparse_step put them).

Checkpoints differ from Qwen3.5-MoE's (models/hf/qwen3_5_moe.py) in the Gated DeltaNet input projections, grouped by
key head: in_proj_qkvz's rows are, for each key head, [q dk | k dk | v g x dv | z g x dv] with g = value heads per
key head (value head i x g + j in key head i's group), in_proj_ba's [b g | a g]; the convolution's channels are [q |
k | v] as Qwen3.5's. Dense layers (mlp.{gate,up,down}_proj of intermediate_size) come first or not at all
(qwen.first_dense_layers). No multi-token-prediction layers are read (mtp.* skipped in one log line).
"""

from __future__ import annotations

import functools

import numpy as np

from models.config import LINEAR, ModelConfig
from models.hf import qwen, qwen3_5, qwen3_5_moe
from models.hf.gqa import norms, router_bias
from models.hf.spec import Family, Nesting, Placement, Tensor, check_fields

ARCHITECTURE = "Qwen3NextForCausalLM"
# Qwen3NextConfig's values for the keys a config.json may leave out
DEFAULTS = {
    **qwen3_5.DEFAULTS,
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 10,
    "num_experts": 512,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "mlp_only_layers": [],
}


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Qwen3NextForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    hf = {**DEFAULTS, **hf}
    return qwen3_5.text_config_from_hf(
        hf,
        "qwen3_next",
        ARCHITECTURE,
        **qwen3_5_moe.expert_fields(hf),
        norm_topk_prob=bool(hf["norm_topk_prob"]),
        first_dense_layers=qwen.first_dense_layers(hf, ARCHITECTURE),
    )


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig of the qwen3_next family -> config.json of a Qwen3NextForCausalLM (its dense layers first:
    mlp_only_layers)."""
    check_fields(config, qwen3_5_moe.EXPERT_FIELDS, ARCHITECTURE)
    return {
        **qwen3_5.text_config_to_hf(config, ARCHITECTURE, "qwen3_next"),
        **qwen3_5_moe.expert_keys(config, ARCHITECTURE),
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(config.num_dense_layers)),
    }


def _group(config: ModelConfig) -> int:
    """Value heads per key head."""
    return config.linear_heads // config.linear_key_heads


def _qkvz_in(weight: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, ...]:
    """in_proj_qkvz weight [key heads x (2 dk + 2 g dv), embed] -> q, k [embed, key heads, dk], v, z [embed, heads,
    dv]."""
    dk, dv, g = config.linear_key_dim, config.linear_value_dim, _group(config)
    grouped = weight.T.reshape(weight.shape[1], config.linear_key_heads, -1)
    q, k, v, z = np.split(grouped, np.cumsum([dk, dk, g * dv])[:3], axis=2)
    return q, k, v.reshape(v.shape[0], -1, dv), z.reshape(z.shape[0], -1, dv)


def _qkvz_out(parts: tuple[np.ndarray, ...], config: ModelConfig) -> np.ndarray:
    """q, k, v, z kernels -> in_proj_qkvz weight: `_qkvz_in` undone."""
    q, k, v, z = parts
    grouped = [p.reshape(p.shape[0], config.linear_key_heads, -1) for p in (q, k, v, z)]
    return np.concatenate(grouped, axis=2).reshape(q.shape[0], -1).T


def _ba_in(weight: np.ndarray, config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """in_proj_ba weight [key heads x 2 g, embed] -> b, a kernels [embed, heads]."""
    g = _group(config)
    grouped = weight.T.reshape(weight.shape[1], config.linear_key_heads, 2 * g)
    return grouped[..., :g].reshape(weight.shape[1], -1), grouped[..., g:].reshape(weight.shape[1], -1)


def _ba_out(parts: tuple[np.ndarray, np.ndarray], config: ModelConfig) -> np.ndarray:
    """b, a kernels [embed, heads] -> in_proj_ba weight: `_ba_in` undone."""
    b, a = (p.reshape(p.shape[0], config.linear_key_heads, -1) for p in parts)
    return np.concatenate([b, a], axis=2).reshape(b.shape[0], -1).T


def linear_attention(block: Placement) -> list[Tensor]:
    """Gated DeltaNet (linear_attn.*) of the layers in our stacked `block`: Qwen3.5's tensors but the input
    projections, grouped by key head."""
    attn, ours, slices = "model.layers.{layer}.linear_attn.", (*block.path, "attn"), block.slices
    grouped = [
        Tensor(attn + "in_proj_qkvz.weight", tuple((*ours, p) for p in "qkvz"), _qkvz_in, _qkvz_out, slices),
        Tensor(attn + "in_proj_ba.weight", ((*ours, "b"), (*ours, "a")), _ba_in, _ba_out, slices),
    ]
    kept = [t for t in qwen3_5.linear_attention(block) if "in_proj_" not in t.hf]
    return grouped + kept


def mixer(config: ModelConfig, block: Placement) -> list[Tensor]:
    """The norms and token mixer of the layers in our stacked `block`."""
    if config.layer_kinds[block.layers[0]] != LINEAR:
        return qwen3_5.mixer(config, block)
    return [*norms(block, qwen3_5.NORMS), *linear_attention(block)]


FAMILY = Family(
    ARCHITECTURE,
    "qwen3_next",
    config_from_hf,
    config_to_hf,
    functools.partial(qwen3_5_moe.tensors, mixer=mixer),
    zeros=router_bias,
    nesting=Nesting.multi_token_prediction("qwen3_next"),
)
