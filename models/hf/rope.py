"""Rotary settings between a config.json and ModelConfig's `rope_theta` / `rope_scaling`.

Newer config.json files carry `rope_parameters` (rope_type, rope_theta and the type's fields), older ones
`rope_theta` and `rope_scaling` (with `rope_type`, or `type`). Both are read; the older form is written, as
every transformers version reads it. A family names the rope types it accepts; a type is added to ROPE_TYPES.

Fields a config.json may leave out (or set to None) are read as transformers reads them: a scaled type's
original_max_position_embeddings is a top-level key of that name when there is one, else the rope parameters',
else max_position_embeddings; a yarn factor left out is max_position_embeddings / original_max_position_embeddings.
"""

from __future__ import annotations

import dataclasses

from layers.rope import RopeScalingConfig
from models.config import ModelConfig
from models.hf.spec import check_required

# Hugging Face rope_type -> (our RopeScalingConfig.type, the RopeScalingConfig fields it carries)
ROPE_TYPES = {
    "default": ("none", ()),
    "linear": ("linear", ("factor",)),
    "llama3": ("llama3", ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    "yarn": (
        "yarn",
        (
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        ),
    ),
}
# Yarn fields transformers lets a config.json leave out (or set to a false value) -> the value that computes the
# same. A zero mscale or mscale_all_dim means "absent" on both sides: the cos/sin factor then depends on `factor`
# alone and the softmax scale is not changed.
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}
# fields not written to a config.json when they have this value (transformers reads their absence so)
OMITTED = {"mscale": 0.0, "mscale_all_dim": 0.0, "truncate": True}
# rope parameters whose other values our rotary embedding cannot represent -> the value it needs
REQUIRED = {"attention_factor": None, "partial_rotary_factor": 1.0}
DEFAULT_THETA = 10000.0


def _parameters(hf: dict) -> dict:
    """The rope parameters of a config.json, in either form, with rope_theta."""
    if hf.get("rope_parameters"):
        return dict(hf["rope_parameters"])
    return dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", DEFAULT_THETA))


def _fill_defaults(kind: str, params: dict, hf: dict) -> dict:
    """The values transformers uses for the fields `params` leaves out (see the module docstring)."""
    if kind in ("default", "linear"):
        return params
    if hf.get("original_max_position_embeddings") is not None:
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    elif params.get("original_max_position_embeddings") is None and "max_position_embeddings" in hf:
        params["original_max_position_embeddings"] = hf["max_position_embeddings"]
    if kind == "yarn":
        if params.get("factor") is None and "max_position_embeddings" in hf:
            params["factor"] = hf["max_position_embeddings"] / params["original_max_position_embeddings"]
        params.update({name: params.get(name) or value for name, value in YARN_DEFAULTS.items()})
        params["truncate"] = params.get("truncate", True)
    return params


def rope_from_hf(hf: dict, architecture: str, supported: tuple[str, ...]) -> dict:
    """config.json -> {"rope_theta": float, "rope_scaling": RopeScalingConfig}; ValueError for another rope type
    or a rope parameter in REQUIRED with another value."""
    params = _parameters(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in supported:
        raise ValueError(
            f"{architecture}: rope type {kind!r} is not supported; supported rope types: {', '.join(supported)}"
        )
    check_required(params, REQUIRED, f"{architecture}: config.json has rope parameter")
    params = _fill_defaults(kind, params, hf)
    ours, fields = ROPE_TYPES[kind]
    missing = [name for name in fields if params.get(name) is None]
    if missing:
        raise ValueError(
            f"{architecture}: rope type {kind!r} needs {', '.join(missing)} in its rope parameters, got {params}"
        )
    defaults = RopeScalingConfig()
    values = {name: type(getattr(defaults, name))(params[name]) for name in fields}
    return {
        "rope_theta": float(params.get("rope_theta", DEFAULT_THETA)),
        "rope_scaling": RopeScalingConfig(type=ours, **values),
    }


def rope_to_hf(config: ModelConfig, architecture: str, supported: tuple[str, ...]) -> dict:
    """ModelConfig -> {"rope_theta": float, "rope_scaling": None or {"rope_type": ..., fields}} for config.json;
    yarn's zero (absent) mscale / mscale_all_dim and a true truncate (transformers' default) are left out."""
    kinds = {ours: kind for kind, (ours, _) in ROPE_TYPES.items() if kind in supported}
    scaling = config.rope_scaling
    if scaling.type not in kinds:
        raise ValueError(
            f"{architecture}: model.rope_scaling.type={scaling.type!r} cannot be exported; "
            f"supported: {', '.join(kinds)}"
        )
    kind = kinds[scaling.type]
    fields = dataclasses.asdict(scaling)
    rope_scaling = {
        "rope_type": kind,
        **{name: fields[name] for name in ROPE_TYPES[kind][1] if name not in OMITTED or fields[name] != OMITTED[name]},
    }
    return {"rope_theta": config.rope_theta, "rope_scaling": None if kind == "default" else rope_scaling}
