"""Creation of parameters annotated with logical axis names.

The names (batch, length, embed, heads, kv_heads, head_dim, mlp, vocab, norm, layers) are stored
in the variable's `out_sharding` metadata, where `flax.nnx.spmd.get_var_pspec` and
`nnx.get_partition_spec` read them. Placement on devices is decided outside the layers, so eager
sharding is switched off: a layer can be built with or without a mesh and logical-axis rules.
"""

from __future__ import annotations

import jax
from flax import nnx


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, axes: tuple[str, ...], dtype) -> nnx.Param:
    """A projection kernel of `shape`, normal with standard deviation 1 / sqrt(fan_in), annotated with `axes`."""
    return logical_param(jax.nn.initializers.normal(stddev=fan_in**-0.5)(rngs.params(), shape, dtype), axes)


def logical_param(value: jax.Array, axes: tuple[str, ...]) -> nnx.Param:
    """Wraps `value` (any shape, one logical axis name per dimension) in an annotated `nnx.Param`."""
    if len(axes) != value.ndim:
        raise ValueError(f"{len(axes)} logical axes {axes} for a parameter of shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)
