"""Sliding-window attention in a config.json, refused until the model has it (the parallel layer's `window=`)."""

from __future__ import annotations

NOT_YET = "sliding-window attention is not supported yet"


def check_no_window(hf: dict, architecture: str, default_window: int | None) -> None:
    """Mistral / Mixtral: every layer attends within `sliding_window` unless it is None; a config.json that leaves
    it out gets its config class's `default_window`."""
    if "sliding_window" not in hf and default_window is not None:
        raise ValueError(
            f"{architecture}: config.json leaves sliding_window out, which transformers reads as {default_window}; "
            f"{NOT_YET} (set sliding_window: null for full attention)"
        )
    if hf.get("sliding_window") is not None:
        raise ValueError(
            f"{architecture}: config.json has sliding_window={hf['sliding_window']!r}; {NOT_YET} (only "
            f"sliding_window=None)"
        )


def check_no_switched_window(hf: dict, architecture: str, windowed_layers: list[int]) -> None:
    """Qwen2 / Qwen3 / Qwen3-MoE: with use_sliding_window true and a sliding_window, `windowed_layers` attend
    within it (the caller reads them as transformers does)."""
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None and windowed_layers:
        raise ValueError(
            f"{architecture}: config.json has use_sliding_window=True (a window of {hf['sliding_window']} in "
            f"{len(windowed_layers)} of {hf['num_hidden_layers']} layers); {NOT_YET} (only use_sliding_window=False)"
        )
