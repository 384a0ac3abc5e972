"""Grouped-query attention's optional parts: q/k/v biases (annotated by head, a bias row repeated as key/value heads
are) and per-head q/k norms, against NumPy on one head of one token."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers.attention import Attention, HeadBias


def test_head_bias_rows_follow_repeated_heads():
    bias = HeadBias(2, 3, ("kv_heads", "head_dim"))
    bias.bias[...] = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    y = np.asarray(bias(jnp.zeros((1, 1, 4, 3))))  # each key/value head repeated twice, as for 4 tensor ranks
    np.testing.assert_array_equal(y[0, 0], np.repeat(np.arange(6).reshape(2, 3), 2, axis=0))
    assert bias.bias.get_metadata()["out_sharding"] == ("kv_heads", "head_dim")


def test_parameters_by_feature():
    plain = Attention(16, 4, 2, 8, rope_theta=1e4, rngs=nnx.Rngs(0))
    assert plain.q_bias is None and plain.q_norm is None
    full = Attention(16, 4, 2, 8, rope_theta=1e4, qkv_bias=True, qk_norm=True, norm_eps=1e-5, rngs=nnx.Rngs(0))
    assert (full.q_bias.bias[...].shape, full.k_bias.bias[...].shape, full.v_bias.bias[...].shape) == (
        (4, 8),
        (2, 8),
        (2, 8),
    )
    assert full.q_norm.scale[...].shape == (8,) and full.k_norm.eps == 1e-5


def test_one_token_attends_to_itself_through_bias_and_norm():
    """A single token: the output is its value (softmax over one key), v = x @ wv + v_bias, whatever q and k are;
    q/k norms and biases then change nothing but must not break the shapes."""
    attention = Attention(8, 2, 1, 4, rope_theta=1e4, qkv_bias=True, qk_norm=True, rngs=nnx.Rngs(0))
    attention.v_bias.bias[...] = jnp.ones((1, 4))
    x = np.random.default_rng(0).normal(size=(1, 1, 8)).astype(np.float32)
    value = x[0, 0] @ np.asarray(attention.v[...])[:, 0] + 1.0  # [head_dim], shared by both query heads
    expected = np.einsum("hd,hde->e", np.stack([value, value]), np.asarray(attention.o[...]))
    out = attention(jnp.asarray(x), jnp.zeros((1, 1), jnp.int32))
    np.testing.assert_allclose(np.asarray(out)[0, 0], expected, rtol=1e-5, atol=1e-6)
