"""Rotary settings between a config.json and ModelConfig's `rope_theta` / `rope_scaling`.

Newer config.json files carry `rope_parameters` (rope_type, rope_theta and the type's fields), older ones
`rope_theta` and `rope_scaling` (with `rope_type`, or `type`). Both are read; the older form is written, as
every transformers version reads it. A family names the rope types it accepts; a type is added to ROPE_TYPES.
"""

from __future__ import annotations

import dataclasses

from train.config import ModelConfig, RopeScalingConfig

# Hugging Face rope_type -> (our RopeScalingConfig.type, the RopeScalingConfig fields it carries)
ROPE_TYPES = {
    "default": ("none", ()),
    "llama3": ("llama3", ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
}
DEFAULT_THETA = 10000.0


def rope_from_hf(hf: dict, architecture: str, supported: tuple[str, ...]) -> dict:
    """config.json -> {"rope_theta": float, "rope_scaling": RopeScalingConfig}; ValueError for another rope type."""
    params = hf.get("rope_parameters") or dict(hf.get("rope_scaling") or {},
                                               rope_theta=hf.get("rope_theta", DEFAULT_THETA))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in supported:
        raise ValueError(f"{architecture}: rope type {kind!r} is not supported; supported rope types: "
                         f"{', '.join(supported)}")
    ours, fields = ROPE_TYPES[kind]
    missing = [name for name in fields if name not in params]
    if missing:
        raise ValueError(f"{architecture}: rope type {kind!r} needs {', '.join(missing)} in its rope parameters, "
                         f"got {params}")
    defaults = RopeScalingConfig()
    values = {name: type(getattr(defaults, name))(params[name]) for name in fields}
    return {"rope_theta": float(params.get("rope_theta", DEFAULT_THETA)),
            "rope_scaling": RopeScalingConfig(type=ours, **values)}


def rope_to_hf(config: ModelConfig, architecture: str, supported: tuple[str, ...]) -> dict:
    """ModelConfig -> {"rope_theta": float, "rope_scaling": None or {"rope_type": ..., fields}} for config.json."""
    kinds = {ours: kind for kind, (ours, _) in ROPE_TYPES.items() if kind in supported}
    scaling = config.rope_scaling
    if scaling.type not in kinds:
        raise ValueError(f"{architecture}: model.rope_scaling.type={scaling.type!r} cannot be exported; "
                         f"supported: {', '.join(kinds)}")
    kind = kinds[scaling.type]
    fields = dataclasses.asdict(scaling)
    rope_scaling = {"rope_type": kind, **{name: fields[name] for name in ROPE_TYPES[kind][1]}}
    return {"rope_theta": config.rope_theta, "rope_scaling": None if kind == "default" else rope_scaling}
