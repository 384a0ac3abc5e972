"""The indexer's loss on one device: over the selection and over every visible key (the dense warm-up), equal to a
dense reference built from [tq, tk] arrays, in value and in the gradients of the indexer's queries, weights and keys,
for the document layouts of the top-k's tests; no gradient reaches the attention's side."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel.kernels import Options, Tokens
from parallel.kernels.index_loss import dense_kl, selection_kl
from parallel.kernels.selected_attention import attention
from parallel.kernels.top_k import index_scores, top_k
from tests.parallel.attention_reference import relative_error
from tests.parallel.test_sparse_attention import (
    BATCH,
    LENGTH,
    dense_attention,
    dense_mask,
    indexer_inputs,
    layouts,
    normal,
)

HEADS, DIM = 4, 16


def attention_inputs(seed=7):
    rng = np.random.default_rng(seed)
    return normal(rng, BATCH, LENGTH, HEADS, DIM), normal(rng, BATCH, LENGTH, 1, DIM)


def reference_kl(q, k, indexer_q, weights, indexer_k, allowed, scale):
    """Dense: p = the attention's probabilities over `allowed` [batch, tq, tk] summed over heads / heads, against the
    softmax of the index scores over `allowed` -> [batch, tq]."""
    _, p = dense_attention(q, k, k, allowed, scale)
    p = p / q.shape[2]
    logits = jnp.where(allowed, index_scores(indexer_q, weights, indexer_k), -jnp.inf)
    lse = jax.nn.logsumexp(logits, -1, keepdims=True)
    log_q = jnp.where(allowed, logits - jnp.where(jnp.isfinite(lse), lse, 0.0), 0.0)
    return jnp.sum(jnp.where(allowed & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0), -1)


def weighted_loss(kl_of, cotangent):
    return lambda *indexer_out: jnp.sum(kl_of(*indexer_out) * cotangent)


@pytest.mark.parametrize("layout, block_kv", [("packed", 8), ("one-document-reordered", 16), ("packed-window", 8)])
def test_dense_warmup_loss_matches_a_dense_reference(layout, block_kv):
    """Blocks of 8 queries over keys in blocks of 8 or 16; the loss >= 0, its value and index gradients within
    2e-5."""
    segment_ids, order, window = layouts()[layout]
    tokens = Tokens(jnp.asarray(segment_ids), jnp.asarray(order, jnp.int32))
    allowed = dense_mask(tokens.segment_ids, tokens.index, window)
    q, k = attention_inputs()
    indexer_out = indexer_inputs(seed=2)
    cotangent = normal(np.random.default_rng(3), BATCH, LENGTH)
    reference = lambda *indexer_out: reference_kl(q, k, *indexer_out, allowed, 0.4)
    expected, expected_grads = jax.value_and_grad(weighted_loss(reference, cotangent), (0, 1, 2))(*indexer_out)
    options = Options(causal=True, window=window, block_q=8, block_kv=block_kv)
    kernel = lambda *indexer_out: dense_kl(q, k, *indexer_out, tokens, tokens, scale=0.4, options=options)
    (value, kl), grads = jax.jit(
        jax.value_and_grad(lambda *x: (weighted_loss(kernel, cotangent)(*x), kernel(*x)), (0, 1, 2), has_aux=True)
    )(*indexer_out)
    np.testing.assert_allclose(kl, reference(*indexer_out), rtol=2e-5, atol=1e-6)
    assert float(jnp.min(kl)) >= -1e-6
    np.testing.assert_allclose(value, expected, rtol=2e-5)
    for grad, want in zip(grads, expected_grads, strict=True):
        assert not np.isnan(np.asarray(grad)).any() and relative_error(grad, want) < 2e-5


@pytest.mark.parametrize("count", [3, 12])
def test_selection_loss_matches_a_dense_reference(count):
    """The attention's head-summed probabilities of the selection as target (parallel.kernels.selected_attention): the
    KL over the selected keys equals the dense reference restricted to them; an all-padding row has loss 0."""
    segment_ids, order, _ = layouts()["packed"]
    tokens = Tokens(jnp.asarray(segment_ids), jnp.asarray(order, jnp.int32))
    indexer_out = indexer_inputs(seed=4)
    selection = top_k(*indexer_out, tokens, tokens, count=count, options=Options(block_q=16, block_kv=16))
    q, k = attention_inputs()
    _, target = attention(q, k, k, selection, scale=0.4, block_q=16)
    rows = jnp.arange(BATCH)[:, None, None], jnp.arange(LENGTH)[None, :, None]
    allowed = jnp.zeros((BATCH, LENGTH, LENGTH), bool).at[(*rows, selection.selected)].max(selection.valid)
    cotangent = normal(np.random.default_rng(5), BATCH, LENGTH)
    kernel = lambda *indexer_out: selection_kl(*indexer_out, selection, target / HEADS, block_q=16)
    kl = jax.jit(kernel)(*indexer_out)
    reference = lambda *indexer_out: reference_kl(q, k, *indexer_out, allowed, 0.4)
    np.testing.assert_allclose(kl, reference(*indexer_out), rtol=2e-5, atol=1e-6)
    assert not np.asarray(kl[-1]).any() and float(jnp.max(kl)) > 0.01  # padding row; a loss that is not trivial
    grads = jax.jit(jax.grad(weighted_loss(kernel, cotangent), (0, 1, 2)))(*indexer_out)
    expected = jax.grad(weighted_loss(reference, cotangent), (0, 1, 2))(*indexer_out)
    for grad, want in zip(grads, expected, strict=True):
        assert not np.isnan(np.asarray(grad)).any() and relative_error(grad, want) < 2e-5


def test_selection_of_every_visible_key_is_the_dense_warmup_loss():
    """count = the whole row: the loss over the selection is the warm-up's loss over every visible key."""
    segment_ids, order, _ = layouts()["packed"]
    tokens = Tokens(jnp.asarray(segment_ids), jnp.asarray(order, jnp.int32))
    indexer_out = indexer_inputs(seed=6)
    options = Options(causal=True, block_q=8, block_kv=8)
    selection = top_k(*indexer_out, tokens, tokens, count=LENGTH, options=options)
    q, k = attention_inputs()
    _, target = attention(q, k, k, selection, scale=0.4, block_q=8)
    sparse = selection_kl(*indexer_out, selection, target / HEADS, block_q=8)
    dense = dense_kl(q, k, *indexer_out, tokens, tokens, scale=0.4, options=options)
    np.testing.assert_allclose(sparse, dense, rtol=2e-5, atol=1e-6)
