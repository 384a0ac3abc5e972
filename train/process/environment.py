"""The process environment the commands (`python -m train`, `train.evaluate`, `train.hf`) set before JAX starts a
backend, each value only where the user has not set it."""

from __future__ import annotations

import os

import jax

from parallel import targets

# XLA flags for GPU runs unless XLA_FLAGS is set: the latency-hiding scheduler lets a ring step's permute (and the
# FSDP gathers) overlap compute. Other backends accept and ignore them.
GPU_XLA_FLAGS = "--xla_gpu_enable_latency_hiding_scheduler=true"
# Share of a GPU's memory XLA may take unless XLA_PYTHON_CLIENT_MEM_FRACTION is set (JAX's own default is 0.75);
# the rest is left to NCCL, cuDNN workspaces and the CUDA context. A GPU plan's verdict uses the same share.
GPU_MEMORY_FRACTION = "0.9"


def default_environment(environ=os.environ) -> None:
    """XLA_FLAGS = GPU_XLA_FLAGS and XLA_PYTHON_CLIENT_MEM_FRACTION = GPU_MEMORY_FRACTION unless set; and on a machine
    with JAX's CUDA plugin but no GPU, JAX_PLATFORMS=cpu unless set (else every JAX start prints the plugin's failed
    cuInit)."""
    environ.setdefault("XLA_FLAGS", GPU_XLA_FLAGS)
    environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
    if targets.plugin_installed() and not targets.gpu_present():
        environ.setdefault("JAX_PLATFORMS", "cpu")


def set_up() -> None:
    """default_environment() for this process, and JAX_PLATFORMS handed to JAX, which read it when imported."""
    default_environment()
    if os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
