"""Hugging Face `DeepseekV32ForCausalLM` <-> our `deepseek` family with sparse attention (model.index_topk > 0).

DeepSeek-V3.2 is DeepSeek-V3 (models/hf/deepseek.py: its routing, experts and latent attention, rotary columns
always interleaved) with a lightning indexer in every layer: `self_attn.indexer.wq_b` [heads * head_dim, q_lora],
`wk` [head_dim, hidden], `k_norm` (a LayerNorm with a bias) and `weights_proj` [heads, hidden], whose rotary
features (the first qk_rope_head_dim of each head) are half-split pairs, as our indexer rotates them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.config import ModelConfig
from models.hf import deepseek
from models.hf.spec import Family, Tensor, heads_in_to_hf, same, transpose

ARCHITECTURE = "DeepseekV32ForCausalLM"
# DeepseekV32Config's values for the keys a config.json may leave out
DEFAULTS = {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a DeepseekV32ForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    if not hf.get("q_lora_rank", deepseek.DEFAULTS["q_lora_rank"]):
        raise ValueError(f"{ARCHITECTURE}: config.json has q_lora_rank={hf['q_lora_rank']!r}; its indexer reads the "
                         "query latent, so only q_lora_rank > 0 is supported")  # fmt: skip
    hf = {**DEFAULTS, **hf}
    return dataclasses.replace(
        deepseek.config_from_hf(hf, ARCHITECTURE),
        index_topk=hf["index_topk"],
        index_heads=hf["index_n_heads"],
        index_head_dim=hf["index_head_dim"],
    )


def is_v32(config: ModelConfig) -> bool:
    """Whether `config` routes as DeepSeek-V3 and attends sparsely with half-split indexer rotary pairs."""
    return config.router_score == "sigmoid" and config.index_topk > 0 and not config.index_rope_interleaved


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig of DeepSeek-V3.2's shape -> config.json of a DeepseekV32ForCausalLM."""
    if not is_v32(config):
        raise ValueError(
            f"{ARCHITECTURE}: model.router_score={config.router_score!r}, model.index_topk={config.index_topk}, "
            f"model.index_rope_interleaved={config.index_rope_interleaved}; DeepSeek-V3.2 routes with 'sigmoid' "
            f"and has an indexer (index_topk > 0) with half-split rotary pairs"
        )
    return {
        **deepseek.hf_config(config, ARCHITECTURE, "deepseek_v32"),
        "norm_topk_prob": config.norm_topk_prob,
        "index_topk": config.index_topk,
        "index_n_heads": config.index_heads,
        "index_head_dim": config.index_head_dim,
        **deepseek.REQUIRED,
    }


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
