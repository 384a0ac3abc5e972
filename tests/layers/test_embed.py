"""Embedding lookup and the [embed, vocab] output matrices."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers.embed import Embed, OutputHead


def test_embed_lookup_and_tied_kernel():
    embed = Embed(16, 4, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tokens = jnp.array([[0, 5, 15], [3, 3, 1]])
    y = embed(tokens)
    table = np.asarray(embed.embedding[...])
    assert y.shape == (2, 3, 4) and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y), table[np.asarray(tokens)].astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(embed.as_output_kernel()), table.T)
    assert embed.embedding.get_metadata()["out_sharding"] == ("vocab", "embed")


def test_output_head():
    head = OutputHead(4, 16, rngs=nnx.Rngs(0))
    kernel = np.asarray(head.output_kernel())
    assert kernel.shape == (4, 16)
    assert head.kernel.get_metadata()["out_sharding"] == ("embed", "vocab")
