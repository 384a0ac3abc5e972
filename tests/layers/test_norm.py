"""RMSNorm against the NumPy formula."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers.norm import RMSNorm


def test_values_match_numpy():
    x = np.asarray(jax.random.normal(jax.random.key(0), (2, 3, 8)))
    norm = RMSNorm(8, eps=1e-6, rngs=nnx.Rngs(0))
    scale = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    norm.scale[...] = jnp.asarray(scale)
    expected = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-6)


def test_shape_dtype_and_annotation():
    norm = RMSNorm(8, param_dtype=jnp.float32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    y = norm(jnp.ones((2, 3, 8), jnp.float32))
    assert y.shape == (2, 3, 8) and y.dtype == jnp.bfloat16
    assert norm.scale[...].dtype == jnp.float32
    assert nnx.spmd.get_var_pspec(norm.scale) == jax.sharding.PartitionSpec("norm")
