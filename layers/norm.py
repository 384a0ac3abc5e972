"""Root-mean-square layer normalisation (as Hugging Face `LlamaRMSNorm`; with offset 1 as `Gemma3RMSNorm`) and layer
normalisation with a bias (torch's `LayerNorm`, as DeepSeek-V3.2's indexer keys use)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from layers.params import logical_param


class RMSNorm(nnx.Module):
    """Normalises the last axis by its root mean square, then scales by offset + `scale` [dim] (ones at first).

    offset 0: Llama's norm, scaled in `dtype`; offset 1: Gemma's, whose stored weight is `scale` (zeros at first,
    so checkpoints round-trip exactly) and which scales in float32 before casting, as Hugging Face's does."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        offset: float = 0.0,
        param_dtype: jnp.dtype = jnp.float32,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        del rngs  # the scale starts at 1 - offset
        self.eps, self.offset = eps, offset
        self.dtype = dtype
        self.scale = logical_param(jnp.full((dim,), 1.0 - offset, param_dtype), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., dim] -> [..., dim] in `dtype`; the statistics are computed in float32."""
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normalised = x32 * jax.lax.rsqrt(variance + self.eps)
        if self.offset:
            return (normalised * (self.offset + self.scale[...].astype(jnp.float32))).astype(self.dtype)
        return normalised.astype(self.dtype) * self.scale[...].astype(self.dtype)


class LayerNorm(nnx.Module):
    """Layer normalisation with a scale and a bias [dim] (ones and zeros at first), as torch's nn.LayerNorm:
    x [..., dim] -> [..., dim] in `dtype`, the statistics computed in float32."""

    def __init__(
        self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32, dtype=jnp.float32, rngs: nnx.Rngs
    ):  # fmt: skip
        del rngs  # ones and zeros
        self.eps, self.dtype = eps, dtype
        self.scale = logical_param(jnp.ones((dim,), param_dtype), ("norm",))
        self.bias = logical_param(jnp.zeros((dim,), param_dtype), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normalised = centred * jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + self.eps)
        return (normalised * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(
            self.dtype
        )
