"""AdamW with linear warmup + cosine decay, global-norm clipping, a weight-decay mask and the first moment's dtype."""

from __future__ import annotations

import jax
import optax

from models.dtypes import DTYPES

NO_DECAY = ("scale", "bias", "sinks")  # norm scales, biases (also any name ending in _bias) and attention sinks


def learning_rate_schedule(config, total_steps: int) -> optax.Schedule:
    """count -> the learning rate of update count + 1 (optax counts the updates already made: step s uses
    schedule(s - 1)). Linear warmup from learning_rate / warmup_steps at the first update to learning_rate at update
    warmup_steps (no update at 0), then cosine to min_lr_ratio * learning_rate at update decay_steps, held after."""
    warmup = max(config.warmup_steps, 1)
    decay_steps = config.decay_steps or total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=config.learning_rate / warmup,
        peak_value=config.learning_rate,
        warmup_steps=warmup - 1,
        decay_steps=max(decay_steps - 1, warmup),
        end_value=config.learning_rate * config.min_lr_ratio,
    )


def parameter_names(path) -> tuple[str, ...]:
    """The attribute names along a parameter's path in the model's state pytree."""
    return tuple(entry.key for entry in path if isinstance(getattr(entry, "key", None), str))


def decay_mask(params):
    """True for parameters that get weight decay: everything but norm scales, biases and attention sinks."""

    def keep(path, _):
        names = parameter_names(path)
        return names[-1] not in NO_DECAY and not names[-1].endswith("_bias")

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(config, total_steps: int) -> optax.GradientTransformation:
    """The optax transformation for an OptimizerConfig: AdamW's first moment `mu` in `mu_dtype` (each update is
    computed at the gradients' precision and rounded when stored), its second moment `nu` in the parameters' dtype,
    both shaped like the parameters."""
    parts = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm > 0 else []
    parts.append(
        optax.adamw(
            learning_rate_schedule(config, total_steps),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask,
            mu_dtype=None if config.mu_dtype == "param" else DTYPES[config.mu_dtype],
        )
    )
    return optax.chain(*parts)
