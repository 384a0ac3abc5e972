"""SwiGLU against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers.mlp import SwiGLU


def test_shape_value_and_annotations():
    mlp = SwiGLU(8, 16, rngs=nnx.Rngs(0))
    assert mlp.gate[...].shape == (8, 16) and mlp.up[...].shape == (8, 16)
    assert mlp.down[...].shape == (16, 8)
    assert mlp.gate.get_metadata()["out_sharding"] == ("embed", "mlp")
    assert mlp.down.get_metadata()["out_sharding"] == ("mlp", "embed")
    x = np.asarray(jax.random.normal(jax.random.key(1), (2, 3, 8)))
    gate, up, down = (np.asarray(p[...]) for p in (mlp.gate, mlp.up, mlp.down))
    pre = x @ gate
    expected = (pre / (1 + np.exp(-pre)) * (x @ up)) @ down
    y = mlp(jnp.asarray(x))
    assert y.shape == (2, 3, 8) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-6)


def test_bfloat16_compute():
    mlp = SwiGLU(8, 16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert mlp(jnp.ones((1, 2, 8))).dtype == jnp.bfloat16
    assert mlp.up[...].dtype == jnp.float32
