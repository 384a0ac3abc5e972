"""Chunked cross-entropy: equal to the plain loss, masking, and no full-length logits."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.loss import chunked_cross_entropy, cross_entropy

BATCH, LENGTH, EMBED, VOCAB = 2, 16, 8, 32


def make_inputs(seed=0, length=LENGTH, vocab=VOCAB):
    keys = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(keys[0], (BATCH, length, EMBED))
    kernel = jax.random.normal(keys[1], (EMBED, vocab)) / math.sqrt(EMBED)
    targets = jax.random.randint(keys[2], (BATCH, length), 0, vocab)
    mask = jax.random.uniform(keys[3], (BATCH, length)) > 0.3
    return hidden, kernel, targets, mask


def test_plain_loss_matches_numpy():
    hidden, kernel, targets, mask = make_inputs()
    logits = np.asarray(hidden, np.float64) @ np.asarray(kernel, np.float64)
    lse = np.log(np.sum(np.exp(logits), axis=-1))
    picked = np.take_along_axis(logits, np.asarray(targets)[..., None], axis=-1)[..., 0]
    expected = np.sum(np.asarray(mask) * (lse - picked))
    loss_sum, weight_sum = cross_entropy(hidden, kernel, targets, mask)
    assert loss_sum.dtype == jnp.float32 and weight_sum.dtype == jnp.float32
    np.testing.assert_allclose(float(loss_sum), expected, rtol=1e-5)
    assert float(weight_sum) == float(np.sum(np.asarray(mask)))


@pytest.mark.parametrize("chunk_size", [1, 8, LENGTH, 4 * LENGTH])
def test_chunked_equals_plain_value_and_gradient(chunk_size):
    hidden, kernel, targets, mask = make_inputs()
    weights = jnp.where(mask, jnp.linspace(0.5, 2.0, LENGTH), 0.0)

    def plain(h, k):
        return cross_entropy(h, k, targets, weights)[0]

    def chunked(h, k):
        return chunked_cross_entropy(h, k, targets, weights, chunk_size=chunk_size)[0]

    np.testing.assert_allclose(float(chunked(hidden, kernel)), float(plain(hidden, kernel)), rtol=1e-5)
    _, weight_sum = chunked_cross_entropy(hidden, kernel, targets, weights, chunk_size=chunk_size)
    np.testing.assert_allclose(float(weight_sum), float(jnp.sum(weights)), rtol=1e-6)
    plain_grads = jax.grad(plain, argnums=(0, 1))(hidden, kernel)
    chunked_grads = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, kernel)
    for got, want in zip(chunked_grads, plain_grads, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_grouped_weights_equal_one_call_per_group():
    """mask [batch, length, groups]: one pass gives each weighting's sums (the eval's position buckets)."""
    hidden, kernel, targets, mask = make_inputs()
    groups = jnp.stack([mask, mask & (jnp.arange(LENGTH) < 5), jnp.zeros_like(mask)], axis=-1)
    loss_sums, weight_sums = chunked_cross_entropy(hidden, kernel, targets, groups, chunk_size=4)
    assert loss_sums.shape == weight_sums.shape == (3,)
    for g in range(3):
        loss_sum, weight_sum = chunked_cross_entropy(hidden, kernel, targets, groups[..., g], chunk_size=4)
        np.testing.assert_allclose(float(loss_sums[g]), float(loss_sum), rtol=1e-6)
        assert float(weight_sums[g]) == float(weight_sum)


def test_masked_tokens_contribute_nothing():
    hidden, kernel, targets, mask = make_inputs()
    other_targets = jnp.where(mask, targets, (targets + 7) % VOCAB)
    assert not np.array_equal(np.asarray(other_targets), np.asarray(targets))
    first = chunked_cross_entropy(hidden, kernel, targets, mask, chunk_size=4)
    second = chunked_cross_entropy(hidden, kernel, other_targets, mask, chunk_size=4)
    np.testing.assert_allclose(np.asarray(first), np.asarray(second), rtol=1e-6)
    unmasked = chunked_cross_entropy(hidden, kernel, targets, jnp.ones_like(mask), chunk_size=4)
    assert float(unmasked[0]) > float(first[0])


def test_bfloat16_compute_is_close():
    hidden, kernel, targets, mask = make_inputs()
    exact, _ = chunked_cross_entropy(hidden, kernel, targets, mask, chunk_size=4)
    low, _ = chunked_cross_entropy(hidden, kernel, targets, mask, chunk_size=4, dtype=jnp.bfloat16)
    assert low.dtype == jnp.float32
    np.testing.assert_allclose(float(low), float(exact), rtol=2e-2)


def test_a_chunk_size_that_does_not_divide_the_length_takes_its_largest_divisor_below():
    hidden, kernel, targets, mask = make_inputs()
    chunks = jax.make_jaxpr(lambda h: chunked_cross_entropy(h, kernel, targets, mask, chunk_size=5))(hidden)
    assert [eqn.params["length"] for eqn in chunks.eqns if eqn.primitive.name == "scan"] == [LENGTH // 4]
    np.testing.assert_allclose(
        chunked_cross_entropy(hidden, kernel, targets, mask, chunk_size=5),
        cross_entropy(hidden, kernel, targets, mask),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="positive"):
        chunked_cross_entropy(hidden, kernel, targets, mask, chunk_size=0)


def largest_intermediate(closed_jaxpr):
    """Element count of the largest value produced anywhere in a jaxpr, nested jaxprs included."""
    largest = 0

    def walk(jaxpr):
        nonlocal largest
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                largest = max(largest, math.prod(getattr(var.aval, "shape", ())))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        walk(sub.jaxpr)

    walk(closed_jaxpr.jaxpr)
    return largest


def test_gradient_never_holds_full_length_logits():
    length, vocab, chunk_size = 64, 128, 16
    hidden, kernel, targets, mask = make_inputs(length=length, vocab=vocab)
    full_logits = BATCH * length * vocab

    def plain(h, k):
        return cross_entropy(h, k, targets, mask)[0]

    def chunked(h, k):
        return chunked_cross_entropy(h, k, targets, mask, chunk_size=chunk_size)[0]

    plain_jaxpr = jax.make_jaxpr(jax.jit(jax.grad(plain, argnums=(0, 1))))(hidden, kernel)
    chunked_jaxpr = jax.make_jaxpr(jax.jit(jax.grad(chunked, argnums=(0, 1))))(hidden, kernel)
    assert largest_intermediate(plain_jaxpr) >= full_logits
    assert largest_intermediate(chunked_jaxpr) < full_logits
    assert largest_intermediate(chunked_jaxpr) >= BATCH * chunk_size * vocab
