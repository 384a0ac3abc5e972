"""Gated feed-forward block: SwiGLU (Llama / DeepSeek dense MLP), or GeGLU with gelu-tanh (Gemma)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import parallel
from layers.params import logical_param

# Truncated normal (within two standard deviations) rescaled to a standard deviation of exactly
# 1 / sqrt(fan_in); fan_in is the first kernel axis.
_kernel_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
# the gate's activation by name: silu (SwiGLU), gelu_tanh (Hugging Face's gelu_pytorch_tanh)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class SwiGLU(nnx.Module):
    """down(act(x @ gate) * (x @ up)), act ACTIVATIONS[activation] (silu); gate, up: [embed, mlp], down: [mlp,
    embed]."""

    def __init__(
        self,
        embed_dim: int,
        mlp_dim: int,
        *,
        activation: str = "silu",
        param_dtype: jnp.dtype = jnp.float32,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dtype, self.activation = dtype, ACTIVATIONS[activation]
        self.gate = logical_param(_kernel_init(rngs.params(), (embed_dim, mlp_dim), param_dtype), ("embed", "mlp"))
        self.up = logical_param(_kernel_init(rngs.params(), (embed_dim, mlp_dim), param_dtype), ("embed", "mlp"))
        self.down = logical_param(_kernel_init(rngs.params(), (mlp_dim, embed_dim), param_dtype), ("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [batch, length, embed] in the residual stream's layout -> [batch, length, embed] in `dtype`, same
        layout (tokens gathered before gate / up, reduce-scattered after down under scattered tensor parallelism)."""
        tokens = parallel.gather(x.astype(self.dtype))
        gate = checkpoint_name(tokens.project("bte,ef->btf", self.gate[...].astype(self.dtype), "f"), "mlp_gate")
        up = checkpoint_name(tokens.project("bte,ef->btf", self.up[...].astype(self.dtype), "f"), "mlp_up")
        down = parallel.project_scatter(
            "btf,fe->bte", self.activation(gate) * up, self.down[...].astype(self.dtype), "f"
        )
        return checkpoint_name(down, "mlp_down")
