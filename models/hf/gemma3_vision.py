"""Hugging Face `Gemma3ForConditionalGeneration` (Gemma 3 4B / 12B / 27B: text and vision) -> our `gemma3` family:
its text model, read as a Gemma3ForCausalLM (models/hf/gemma3.py) from config.json's text_config and the tensors
under language_model.model. (the published files; their lm_head under language_model.lm_head.) or
model.language_model. (the module names transformers loads them into). The vision tower and its projector are
skipped; exports write a Gemma3ForCausalLM.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.hf import gemma3
from models.hf.spec import Family, Nesting, never

ARCHITECTURE = "Gemma3ForConditionalGeneration"
NESTING = Nesting(
    prefixes=(
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),
    ),
    skipped=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
    reason="the vision tower and its projector, which the gemma3 text model does not use",
)


def config_from_hf(hf: dict) -> ModelConfig:
    """config.json of a Gemma3ForConditionalGeneration -> the ModelConfig of its text model (text_config, its
    left-out keys Gemma3TextConfig's defaults)."""
    return gemma3.config_from_hf(hf.get("text_config") or {})


FAMILY = Family(
    ARCHITECTURE, "gemma3", config_from_hf, gemma3.config_to_hf, gemma3.tensors, exports=never, nesting=NESTING
)
