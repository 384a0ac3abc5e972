"""`model_from_init: true` in a run config: the model is checkpoint.init_from's, an import (`python -m train.hf import
HF_DIR OUT` wrote OUT/model.yaml, OUT/hf_config.json and OUT/tokenizer.json). What the import says is the config's
lowest layer: the config's own keys go over it, and command-line overrides over those."""

from __future__ import annotations

import json
import pathlib
import typing

from models.config import require
from train.config.strict_yaml import parse_yaml

MODEL_FROM_INIT = "model_from_init"
MODEL_YAML = "model.yaml"
HF_CONFIG = "hf_config.json"
TOKENIZER = "tokenizer.json"


def import_layer(init_from: typing.Any) -> dict:
    """The keys an import gives a run config: {"model": its model.yaml's architecture, "data": {"tokenizer": its
    tokenizer.json}} (no data without one). A model.yaml that leaves max_position_embeddings 0 (one written before the
    field) takes hf_config.json's. ConfigError when init_from is not an import's directory."""
    require(
        isinstance(init_from, str) and bool(init_from),
        f"{MODEL_FROM_INIT}: true takes the model from checkpoint.init_from, which is {init_from!r}; give "
        f"checkpoint.init_from=DIR, the output of python -m train.hf import HF_DIR DIR",
    )
    directory = pathlib.Path(init_from)
    model = _read_model(directory / MODEL_YAML, init_from)
    if not model.get("max_position_embeddings"):
        model["max_position_embeddings"] = _hf_max_positions(directory / HF_CONFIG)
    layer = {"model": model}
    if (directory / TOKENIZER).is_file():
        layer["data"] = {"tokenizer": str(directory / TOKENIZER)}
    return layer


def _read_model(path: pathlib.Path, init_from: str) -> dict:
    """The `model:` mapping of an import's model.yaml; ConfigError naming init_from when there is none."""
    require(
        path.is_file(),
        f"checkpoint.init_from={init_from!r} has no {MODEL_YAML}, and {MODEL_FROM_INIT}: true takes the architecture "
        f"from it; allowed: an import's directory (python -m train.hf import HF_DIR DIR), or a config that states "
        f"the model (base: a configs/models/*.yaml) without {MODEL_FROM_INIT}",
    )
    try:
        model = (parse_yaml(path.read_text(), f"config {path}") or {}).get("model")
    except AttributeError:
        model = None
    require(isinstance(model, dict), f"{path} holds no `model:` mapping; import the checkpoint again")
    return model


def _hf_max_positions(path: pathlib.Path) -> int:
    """max_position_embeddings of an import's hf_config.json; 0 when it has none."""
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings") if path.is_file() else 0
    except (json.JSONDecodeError, AttributeError):
        value = 0
    return value if isinstance(value, int) else 0
