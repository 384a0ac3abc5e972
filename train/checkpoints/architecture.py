"""Whether a checkpoint holds the run's model: the architecture of an import (its model.yaml) or of a run's
checkpoint (the resolved config in its `meta` item) against a run's `model` section, key by key. Equal shapes are
not enough: a sliding window, layer types, sinks or a rope base change the model without changing a parameter."""

from __future__ import annotations

import dataclasses
import pathlib

from models.config import ModelConfig
from train.checkpoints.checkpoint import read_meta
from train.config import from_dict, load_config
from train.config.imported import MODEL_YAML
from train.errors import CheckpointError

# what a fine-tune may change: the context it covers (rope scaling, positions), the parameters' dtype, how training
# updates the router's bias and weighs its load-balancing loss, and how it trains the indexer
FREE = (
    "rope_scaling",
    "context_length",
    "max_position_embeddings",
    "param_dtype",
    "router_bias_rate",
    "router_aux_loss_coef",
    "router_aux_loss_scope",
    "indexer_training",
    "indexer_loss_coef",
)


def saved_model(directory: pathlib.Path) -> ModelConfig | None:
    """The model config of a checkpoint directory: an import's model.yaml, else a run step's `meta` item (raising
    Unreadable when it cannot be read); None when it has neither."""
    if (directory / MODEL_YAML).is_file():
        return load_config(directory / MODEL_YAML).model
    if (directory / "meta").is_dir():
        return from_dict(ModelConfig, read_meta(directory)["config"]["model"], "model.")
    return None


# what sparse attention's indexer adds to a model that had none (DeepSeek-V3 given one, as V3.2 was made)
INDEXER_KEYS = ("index_topk", "index_heads", "index_head_dim", "index_rope_interleaved")


def adds_indexer(saved: ModelConfig, current: ModelConfig) -> bool:
    """Whether `current` gives sparse attention's indexer to a model `saved` without one."""
    return not saved.index_topk and current.index_topk > 0


def differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """`key: X there, Y here` for each architecture key (not FREE) on which two model configs differ; an indexer
    added to a model without one is no difference in the dense warm-up, which trains it from fresh parameters."""
    there, here = dataclasses.asdict(saved), dataclasses.asdict(current)
    added = adds_indexer(saved, current) and current.indexer_training == "warmup"
    return [
        f"{key}: {there[key]!r} there, {here[key]!r} here"
        for key in here
        if key not in FREE and there[key] != here[key] and not (added and key in INDEXER_KEYS)
    ]


def check_architecture(directory: pathlib.Path, current: ModelConfig) -> None:
    """Raises CheckpointError naming the keys on which the model saved in `directory` differs from `current`; a
    directory that states no model (only its shapes can be compared) passes."""
    saved = saved_model(directory)
    found = differences(saved, current) if saved is not None else []
    if found:
        hint = (
            ". A new indexer trains alone first: model.indexer_training=warmup"
            if saved is not None and adds_indexer(saved, current)
            else ""
        )
        raise CheckpointError(
            f"checkpoint.init_from: {directory} holds another model than this run's ({'; '.join(found)}). Start "
            f"from a config with that model (model_from_init: true takes an import's), or set these keys as it has "
            f"them{hint}"
        )
