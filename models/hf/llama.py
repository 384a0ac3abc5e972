"""Hugging Face `LlamaForCausalLM` <-> our `llama` family (Llama 2 / 3 / 3.1 / 3.2); shared layout in
models/hf/gqa.py."""

from __future__ import annotations

from models.config import ModelConfig
from models.hf import gqa
from models.hf.spec import Family, Tensor, check_fields
from models.hf.window import no_window

ARCHITECTURE = "LlamaForCausalLM"
ROPE_TYPES = ("default", "llama3")
# config.json keys whose other values our model cannot represent -> the value it needs
REQUIRED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
# LlamaConfig's values for the keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}
# ModelConfig fields a LlamaForCausalLM holds only with these values
FIELDS = {"qkv_bias": False, "qk_norm": False}


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a LlamaForCausalLM -> ModelConfig (runtime fields left at their defaults)."""
    return gqa.config_from_hf({**DEFAULTS, **hf}, "llama", ARCHITECTURE, REQUIRED, ROPE_TYPES)


def config_to_hf(config: ModelConfig) -> dict:
    """ModelConfig -> config.json of a LlamaForCausalLM."""
    check_fields(config, FIELDS, ARCHITECTURE)
    no_window(config, ARCHITECTURE)
    return {**gqa.config_to_hf(config, ARCHITECTURE, "llama", ROPE_TYPES), **REQUIRED}


def tensors(config: ModelConfig) -> list[Tensor]:
    """Every tensor of a LlamaForCausalLM checkpoint; lm_head.weight only when embeddings are untied."""
    return gqa.checkpoint(config, gqa.layers(config, "layers", gqa.mlp))


FAMILY = Family(ARCHITECTURE, "llama", config_from_hf, config_to_hf, tensors)
