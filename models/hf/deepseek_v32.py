"""Hugging Face `DeepseekV32ForCausalLM` and `GlmMoeDsaForCausalLM` (GLM-5) <-> our `deepseek` family with sparse
attention (model.index_topk > 0).

DeepSeek-V3.2 is DeepSeek-V3 (models/hf/deepseek.py: its routing, experts and latent attention, rotary columns
always interleaved) with a lightning indexer in every layer: `self_attn.indexer.wq_b` [heads * head_dim, q_lora],
`wk` [head_dim, hidden], `k_norm` (a LayerNorm with a bias) and `weights_proj` [heads, hidden], whose rotary
features (the first qk_rope_head_dim of each head) are half-split pairs, as our indexer rotates them. GLM-5 is the
same with interleaved indexer pairs (model.index_rope_interleaved), other defaults, and layers whose config.json
`indexer_types` may be "shared" (reusing an earlier layer's selection, which we do not build: every layer "full").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.config import ModelConfig
from models.hf import deepseek
from models.hf.spec import Family, Tensor, heads_in_to_hf, same, transpose

ARCHITECTURE = "DeepseekV32ForCausalLM"
GLM_ARCHITECTURE = "GlmMoeDsaForCausalLM"
# DeepseekV32Config's values for the keys a config.json may leave out (the others are DeepseekV3Config's)
DEFAULTS = {**deepseek.DEFAULTS, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
# GlmMoeDsaConfig's
GLM_DEFAULTS = {
    **DEFAULTS,
    "q_lora_rank": 2048,
    "n_group": 1,
    "topk_group": 1,
    "rms_norm_eps": 1e-5,
    "index_n_heads": 32,
}


def _indexer_types(hf: dict) -> list[str]:
    """GLM-5's per-layer indexer modes, as GlmMoeDsaConfig derives them: indexer_types, else index_topk_pattern
    ("F" full, "S" shared), else every index_topk_freq-th layer full from index_skip_topk_offset."""
    if hf.get("indexer_types"):
        return list(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(hf["num_hidden_layers"])]


def _config_from_hf(hf: dict, architecture: str, defaults: dict, interleaved: bool) -> ModelConfig:
    hf = {**defaults, **hf}
    if not hf["q_lora_rank"]:
        raise ValueError(f"{architecture}: config.json has q_lora_rank={hf['q_lora_rank']!r}; its indexer reads the "
                         "query latent, so only q_lora_rank > 0 is supported")  # fmt: skip
    return dataclasses.replace(
        deepseek.config_from_hf(hf, architecture),
        index_topk=hf["index_topk"],
        index_heads=hf["index_n_heads"],
        index_head_dim=hf["index_head_dim"],
        index_rope_interleaved=interleaved,
    )


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a DeepseekV32ForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    return _config_from_hf(hf, ARCHITECTURE, DEFAULTS, interleaved=False)


def glm_config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a GlmMoeDsaForCausalLM whose layers all run their indexer -> ModelConfig."""
    shared = [i for i, kind in enumerate(_indexer_types({**GLM_DEFAULTS, **hf})) if kind != "full"]
    if shared:
        raise ValueError(
            f"{GLM_ARCHITECTURE}: config.json makes layers {shared} 'shared' (indexer_types / index_topk_pattern / "
            f"index_topk_freq), reusing an earlier layer's selection; only every layer 'full' is supported"
        )
    return _config_from_hf(hf, GLM_ARCHITECTURE, GLM_DEFAULTS, interleaved=True)


def is_v32(config: ModelConfig) -> bool:
    """Whether `config` routes as DeepSeek-V3 and attends sparsely with half-split indexer rotary pairs."""
    return config.router_score == "sigmoid" and config.index_topk > 0 and not config.index_rope_interleaved


def is_glm(config: ModelConfig) -> bool:
    """Whether `config` routes as DeepSeek-V3 and attends sparsely with interleaved indexer rotary pairs."""
    return config.router_score == "sigmoid" and config.index_topk > 0 and config.index_rope_interleaved


def _config_to_hf(config: ModelConfig, architecture: str, model_type: str, interleaved: bool) -> dict:
    if not (is_glm if interleaved else is_v32)(config):
        raise ValueError(
            f"{architecture}: model.router_score={config.router_score!r}, model.index_topk={config.index_topk}, "
            f"model.index_rope_interleaved={config.index_rope_interleaved}; it routes with 'sigmoid' and has an "
            f"indexer (index_topk > 0) with {'interleaved' if interleaved else 'half-split'} rotary pairs"
        )
    return {
        **deepseek.hf_config(config, architecture, model_type),
        "norm_topk_prob": config.norm_topk_prob,
        "index_topk": config.index_topk,
        "index_n_heads": config.index_heads,
        "index_head_dim": config.index_head_dim,
        **deepseek.REQUIRED,
    }


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig of DeepSeek-V3.2's shape -> config.json of a DeepseekV32ForCausalLM."""
    return _config_to_hf(config, ARCHITECTURE, "deepseek_v32", interleaved=False)


def glm_config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig of GLM-5's shape -> config.json of a GlmMoeDsaForCausalLM (every layer's indexer "full")."""
    return {**_config_to_hf(config, GLM_ARCHITECTURE, "glm_moe_dsa", interleaved=True), "index_topk_freq": 1}


def _index_heads_in(weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """wq_b weight [index heads * index head_dim, q_lora] -> kernel [q_lora, index heads, index head_dim]."""
    return weight.T.reshape(weight.shape[1], config.index_heads, -1)


def _indexer(stack: str, slices) -> list[Tensor]:
    """The indexer tensors of the layers of `stack`."""
    hf, ours = "model.layers.{layer}.self_attn.indexer.", (stack, "attn", "indexer")
    return [
        Tensor(hf + "wq_b.weight", (*ours, "wq_b"), _index_heads_in, heads_in_to_hf, slices),
        Tensor(hf + "wk.weight", (*ours, "wk"), transpose, transpose, slices),
        Tensor(hf + "k_norm.weight", (*ours, "k_norm", "scale"), same, same, slices),
        Tensor(hf + "k_norm.bias", (*ours, "k_norm", "bias"), same, same, slices),
        Tensor(hf + "weights_proj.weight", (*ours, "weights"), transpose, transpose, slices),
    ]


def tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a DeepseekV32ForCausalLM checkpoint: DeepSeek-V3's with each layer's indexer."""
    return deepseek.table(config, interleaved=True, selection_bias=True, indexer=_indexer)


FAMILY = Family(ARCHITECTURE, "deepseek", config_from_hf, config_to_hf, tensors, exports=is_v32)
GLM_FAMILY = Family(GLM_ARCHITECTURE, "deepseek", glm_config_from_hf, glm_config_to_hf, tensors, exports=is_glm)
