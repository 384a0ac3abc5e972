"""The embedding lookup on a mesh (parallel/lookup.py) equals a plain `take` in value and in the table's gradient on
meshes that split the table's embed over fsdp x the sequence axes and its vocab over `tensor` (scattered or not),
moves the tokens rather than the table, and leaves a sampled prompt that does not split to the partitioner."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from parallel.lookup import lookup
from parallel.mesh import batch_sharding, logical_spec, make_mesh
from parallel.parallelism import Parallelism, use_parallelism
from parallel.tensor import residual_spec
from train.config import MeshConfig

VOCAB, EMBED, BATCH, LENGTH = 48, 16, 4, 32
MESHES = [
    ({"fsdp": 2, "context": 4}, True),
    ({"data": 2, "fsdp": 2, "ulysses": 2}, True),
    ({"fsdp": 2, "context": 2, "tensor": 2}, True),  # vocab over tensor, tokens scattered over it
    ({"fsdp": 2, "context": 2, "tensor": 2}, False),  # vocab over tensor, tokens copied on it
    ({"expert": 2, "context": 2, "tensor": 2}, True),  # embed over context only
]


def inputs(vocab: int = VOCAB):
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(vocab, EMBED)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (BATCH, LENGTH)), jnp.int32)
    cotangent = jnp.asarray(rng.normal(size=(BATCH, LENGTH, EMBED)), jnp.float32)
    return table, tokens, cotangent


def value_and_table_grad(table, tokens, cotangent):
    """(the lookup in bfloat16, d <lookup, cotangent> / d table)."""
    out, pull = jax.vjp(lambda t: lookup(t, tokens, jnp.bfloat16), table)
    return out, pull(cotangent.astype(jnp.bfloat16))[0]


def on_mesh(shape, scatter, table, tokens, cotangent):
    """value_and_table_grad compiled on the mesh `shape`, the table placed as a parameter and the tokens as a batch;
    -> (value, gradient, the compiled program's text)."""
    with use_parallelism(Parallelism(scatter=scatter)):
        mesh = make_mesh(MeshConfig(**{"fsdp": 1, **shape}))
        with jax.set_mesh(mesh):
            table_sharding = NamedSharding(mesh, logical_spec(("vocab", "embed"), mesh, table.shape))
            shardings = (table_sharding, batch_sharding(mesh), NamedSharding(mesh, residual_spec()))
            # a fresh function: jit's cache does not know the parallelism
            step = jax.jit(lambda *args: value_and_table_grad(*args), in_shardings=shardings)
            compiled = step.lower(table, tokens, cotangent).compile()
            value, grad = compiled(table, tokens, cotangent)
            assert value.sharding.is_equivalent_to(NamedSharding(mesh, residual_spec()), value.ndim)
    return np.asarray(value, np.float32), np.asarray(grad), compiled.as_text()


@pytest.mark.parametrize(
    "shape, scatter",
    MESHES,
    ids=[f"{'-'.join(f'{k}{v}' for k, v in s.items())}{'' if c else '-unscattered'}" for s, c in MESHES],
)
def test_lookup_on_a_mesh_equals_take_with_the_tables_gradient(shape, scatter):
    table, tokens, cotangent = inputs()
    expected_value, expected_grad = jax.jit(value_and_table_grad)(table, tokens, cotangent)
    value, grad, text = on_mesh(shape, scatter, table, tokens, cotangent)
    np.testing.assert_array_equal(value, np.asarray(expected_value, np.float32))
    np.testing.assert_allclose(grad, np.asarray(expected_grad), rtol=1e-6, atol=1e-6)
    # no device holds its vocab rows' whole embed: the table is not gathered, in the forward nor in the backward
    assert not re.search(rf"f32\[({VOCAB}|{VOCAB // 2}),{EMBED}\]", text), "the table was gathered"


def test_a_vocab_that_tensor_does_not_divide_and_an_unsplit_prompt_equal_take():
    table, tokens, cotangent = inputs(vocab=VOCAB + 1)  # 49 rows: vocab stays whole on every tensor rank
    expected_value, expected_grad = jax.jit(value_and_table_grad)(table, tokens, cotangent)
    value, grad, _ = on_mesh({"fsdp": 2, "context": 2, "tensor": 2}, True, table, tokens, cotangent)
    np.testing.assert_array_equal(value, np.asarray(expected_value, np.float32))
    np.testing.assert_allclose(grad, np.asarray(expected_grad), rtol=1e-6, atol=1e-6)
    with jax.set_mesh(make_mesh(MeshConfig(fsdp=2, context=4))):  # one row of 3 tokens: no split, a plain take
        prompt = tokens[:1, :3]
        np.testing.assert_array_equal(
            np.asarray(jax.jit(lookup, static_argnums=2)(table, prompt, jnp.float32)), np.asarray(table)[prompt]
        )
