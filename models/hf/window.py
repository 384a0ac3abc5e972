"""Sliding-window attention between a config.json and ModelConfig's `sliding_window` / `layer_types`.

Mistral and Mixtral window every layer with `sliding_window` unless it is None; Qwen2 and Qwen3, with
use_sliding_window, the layers layer_types calls sliding_attention (else those from max_window_layers on); Qwen3-MoE,
with use_sliding_window, every layer. Ours holds a window of every layer as sliding_window alone, of some layers
with layer_types too.
"""

from __future__ import annotations

from models.config import FULL, SLIDING, ModelConfig


def window_from_hf(hf: dict, windowed: list[int]) -> dict:
    """The ModelConfig fields of a window of hf's sliding_window (None: no window) in layers `windowed` of its
    num_hidden_layers: {} for none, {"sliding_window"} for all, else {"sliding_window", "layer_types"}."""
    layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if window is None or not windowed:
        return {}
    if len(windowed) == layers:
        return {"sliding_window": int(window)}
    kinds = tuple(SLIDING if layer in windowed else FULL for layer in range(layers))
    return {"sliding_window": int(window), "layer_types": kinds}


def switched_windowed_layers(hf: dict) -> list[int]:
    """Layers Qwen2 / Qwen3 window: none without use_sliding_window, else those layer_types calls
    sliding_attention, else those from max_window_layers on."""
    if not hf.get("use_sliding_window"):
        return []
    if hf.get("layer_types"):
        return [i for i, kind in enumerate(hf["layer_types"]) if kind == SLIDING]
    return list(range(hf["max_window_layers"], hf["num_hidden_layers"]))


def every_layer_window(config: ModelConfig, architecture: str) -> int | None:
    """The window an architecture that windows every layer or none holds (None: none); ValueError naming
    model.layer_types when only some layers slide."""
    kinds = set(config.layer_kinds)
    if len(kinds) > 1:
        raise ValueError(
            f"{architecture} cannot hold model.layer_types={list(config.layer_types)!r}: it slides every layer or "
            f"none (model.layer_types=[] with model.sliding_window > 0 or 0)"
        )
    return config.sliding_window if kinds == {SLIDING} else None


def no_window(config: ModelConfig, architecture: str) -> None:
    """ValueError naming model.sliding_window for an architecture without sliding windows when a layer slides."""
    if SLIDING in config.layer_kinds:
        raise ValueError(
            f"{architecture} cannot hold model.sliding_window={config.sliding_window}: it has no sliding windows "
            f"(model.sliding_window=0)"
        )


def switched_window_to_hf(config: ModelConfig) -> dict:
    """Qwen2 / Qwen3's config.json keys of our window: use_sliding_window off without one; else the window, its
    layer_types and max_window_layers (the full layers before the first sliding one)."""
    kinds = config.layer_kinds
    if SLIDING not in kinds:
        return {"use_sliding_window": False, "sliding_window": None}
    return {
        "use_sliding_window": True,
        "sliding_window": config.sliding_window,
        "max_window_layers": kinds.index(SLIDING),
        "layer_types": list(kinds),
    }
