"""Parameter and compute dtypes from config names."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def param_dtype(config):
    return NAMES[config.param_dtype]


def compute_dtype(config):
    """`auto` is bfloat16 on GPU/TPU and float32 on CPU."""
    if config.dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return NAMES[config.dtype]
