"""AdamW with linear warmup + cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import optax

NO_DECAY = ("scale", "bias")  # norm scales and biases are not decayed


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
