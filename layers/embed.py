"""Token embedding table and untied output projection; both expose the [embed, vocab] logits matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import parallel
from layers.params import logical_param

# Output kernel: truncated normal with standard deviation 1 / sqrt(embed_dim) (fan_in = first axis).
_output_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class Embed(nnx.Module):
    """Token lookup in `embedding`: [vocab, embed], initialised normal with standard deviation 0.02, times `scale` in
    `dtype` (Gemma: sqrt(embed))."""

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        *,
        scale: float = 1.0,
        param_dtype: jnp.dtype = jnp.float32,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dtype, self.scale = dtype, scale
        init = nnx.initializers.normal(stddev=0.02)
        self.embedding = logical_param(init(rngs.params(), (vocab_size, embed_dim), param_dtype), ("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """tokens: [batch, length] int -> [batch, length, embed] in `dtype` (the residual stream's layout)."""
        embedded = parallel.lookup(self.embedding[...], tokens, self.dtype)
        return embedded if self.scale == 1.0 else embedded * jnp.asarray(self.scale, self.dtype)

    def as_output_kernel(self) -> jax.Array:
        """Tied output matrix: the transposed table, [embed, vocab] in `param_dtype`."""
        return self.embedding[...].T


class OutputHead(nnx.Module):
    """Untied output projection `kernel`: [embed, vocab], truncated normal with std 1 / sqrt(embed)."""

    def __init__(self, embed_dim: int, vocab_size: int, *, param_dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        self.kernel = logical_param(
            _output_init(rngs.params(), (embed_dim, vocab_size), param_dtype), ("embed", "vocab")
        )

    def output_kernel(self) -> jax.Array:
        """Output matrix [embed, vocab] in `param_dtype`, for `layers.loss` (chunked loss)."""
        return self.kernel[...]
