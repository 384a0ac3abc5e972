"""AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import optax

NO_DECAY = ("scale", "bias")  # norm scales and biases are not decayed


def learning_rate_schedule(config, total_steps: int) -> optax.Schedule:
    """0 -> learning_rate over warmup_steps, then cosine to min_lr_ratio * learning_rate at decay_steps."""
    decay_steps = config.decay_steps or total_steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=max(decay_steps, config.warmup_steps + 1),
        end_value=config.learning_rate * config.min_lr_ratio,
    )


def decay_mask(params):
    """True for parameters that get weight decay: everything but norm scales and biases."""

    def keep(path, _):
        names = [entry.key for entry in path if isinstance(getattr(entry, "key", None), str)]
        return names[-1] not in NO_DECAY

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(config, total_steps: int) -> optax.GradientTransformation:
    """The optax transformation for an OptimizerConfig."""
    parts = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm > 0 else []
    parts.append(
        optax.adamw(
            learning_rate_schedule(config, total_steps),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
