"""The families that convert to and from Hugging Face; a new family adds its `FAMILY` to FAMILIES."""

from __future__ import annotations

from models.config import ModelConfig
from models.hf import (
    deepseek,
    deepseek_v32,
    gemma3,
    gemma3_vision,
    gpt_oss,
    llama,
    mistral,
    qwen,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
)
from models.hf.spec import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    deepseek.FAMILY,
    deepseek.V2_FAMILY,
    deepseek_v32.FAMILY,
    deepseek_v32.GLM_FAMILY,
    qwen.QWEN2_FAMILY,
    qwen.QWEN3_FAMILY,
    qwen.QWEN3_MOE_FAMILY,
    mistral.MISTRAL_FAMILY,
    mistral.MIXTRAL_FAMILY,
    gemma3.FAMILY,
    gemma3_vision.FAMILY,
    gpt_oss.FAMILY,
    qwen3_5.FAMILY,
    qwen3_5.VL_FAMILY,
    qwen3_5_moe.FAMILY,
    qwen3_5_moe.VL_FAMILY,
    qwen3_next.FAMILY,
)


def by_architecture(hf_config: dict) -> Family:
    """The family of a config.json, from `architectures[0]`; ValueError naming it and the supported ones."""
    architectures = hf_config.get("architectures") or [None]
    for family in FAMILIES:
        if family.architecture == architectures[0]:
            return family
    raise ValueError(
        f"architecture {architectures[0]!r} is not supported; supported architectures: "
        f"{', '.join(f.architecture for f in FAMILIES)}"
    )


def for_export(config: ModelConfig) -> Family:
    """The converter that exports `config`: the first of its `family` whose `exports(config)` holds; ValueError
    naming the family and the supported ones."""
    for family in FAMILIES:
        if family.family == config.family and family.exports(config):
            return family
    raise ValueError(
        f"model.family={config.family!r} cannot be converted to Hugging Face; supported families: "
        f"{', '.join(dict.fromkeys(f.family for f in FAMILIES))}"
    )
