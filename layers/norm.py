"""Root-mean-square layer normalisation (as Hugging Face `LlamaRMSNorm`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from layers.params import logical_param


class RMSNorm(nnx.Module):
    """Normalises the last axis by its root mean square, then scales; `scale`: [dim]."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        param_dtype: jnp.dtype = jnp.float32,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        del rngs  # the scale starts at ones
        self.eps = eps
        self.dtype = dtype
        self.scale = logical_param(jnp.ones((dim,), param_dtype), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in `dtype`; the statistics are computed in float32."""
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normalised = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(self.dtype)
        return normalised * self.scale[...].astype(self.dtype)
