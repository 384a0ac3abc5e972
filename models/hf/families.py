"""The families that convert to and from Hugging Face; a new family adds its `FAMILY` to FAMILIES."""

from __future__ import annotations

from models.hf import llama
from models.hf.spec import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY,)


def by_architecture(hf_config: dict) -> Family:
    """The family of a config.json, from `architectures[0]`; ValueError naming it and the supported ones."""
    architectures = hf_config.get("architectures") or [None]
    for family in FAMILIES:
        if family.architecture == architectures[0]:
            return family
    raise ValueError(f"architecture {architectures[0]!r} is not supported; supported architectures: "
                     f"{', '.join(f.architecture for f in FAMILIES)}")


def by_family(name: str) -> Family:
    """The converter of `ModelConfig.family` `name`; ValueError naming it and the supported ones."""
    for family in FAMILIES:
        if family.family == name:
            return family
    raise ValueError(f"model.family={name!r} cannot be converted to Hugging Face; supported families: "
                     f"{', '.join(f.family for f in FAMILIES)}")
