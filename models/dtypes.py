"""Parameter and compute dtypes from config names."""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PARAM_DTYPES = ("float32", "bfloat16")  # what parameters are stored in
COMPUTE_DTYPES = ("auto", *DTYPES)  # auto = bfloat16 on GPU/TPU, float32 on CPU


def param_dtype(config):
    """The parameter dtype of a ModelConfig."""
    return DTYPES[config.param_dtype]


def compute_dtype(compute):
    """The compute dtype of a ComputeConfig; `auto` is bfloat16 on GPU/TPU and float32 on CPU."""
    if compute.dtype == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return DTYPES[compute.dtype]
