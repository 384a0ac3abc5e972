"""DeepSeek-V3.2's sparse attention on one device: the blockwise top-k equals a dense top-k of the index scores (the
same scores, ties aside) for several block sizes and document layouts, and attention over the selection equals dense
attention under the selection's mask in outputs, gradients and the head-summed probabilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel.kernels import Options, Tokens
from parallel.kernels.selected_attention import attention
from parallel.kernels.top_k import Selection, index_scores, top_k
from parallel.segments import visible_pairs
from tests.parallel.attention_reference import packed_segments, relative_error

BATCH, LENGTH = 3, 40


def normal(rng, *shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def layouts():
    """name -> (segment ids [batch, length], global indices [length], window)."""
    one = np.ones((BATCH, LENGTH), np.int32)
    order = np.arange(LENGTH)
    chunks = np.concatenate([order[:10], order[30:], order[10:20], order[20:30]])  # a dual-chunk piece order
    return {
        "packed": (packed_segments(BATCH, LENGTH), order, None),
        "one-document-reordered": (one, chunks, None),
        "packed-window": (packed_segments(BATCH, LENGTH, seed=3), order, 7),
    }


def dense_mask(segment_ids, index, window):
    """[batch, length, length] visibility, queries by keys."""
    side = lambda axis: Tokens(jnp.expand_dims(segment_ids, axis), jnp.expand_dims(index, axis - 1))
    return visible_pairs(side(2), side(1), causal=True, window=window)


def indexer_inputs(seed=0, heads=3, dim=8):
    rng = np.random.default_rng(seed)
    return normal(rng, BATCH, LENGTH, heads, dim), normal(rng, BATCH, LENGTH, heads), normal(rng, BATCH, LENGTH, dim)


@pytest.mark.parametrize("layout", list(layouts()))
def test_top_k_matches_dense_top_k(layout):
    """Counts below and above what a query sees; blocks that divide the length and blocks that do not."""
    segment_ids, index, window = layouts()[layout]
    q, weights, k = indexer_inputs()
    tokens = Tokens(jnp.asarray(segment_ids), jnp.asarray(index, jnp.int32))
    mask = dense_mask(tokens.segment_ids, tokens.index, window)
    dense = jnp.where(mask, index_scores(q, weights, k), -jnp.inf)
    for count, block_q, block_kv in [(5, 8, 8), (16, 16, 24), (LENGTH, 64, 64)]:
        options = Options(causal=True, window=window, block_q=block_q, block_kv=block_kv)
        selection = jax.jit(top_k, static_argnames=("count", "options"))(
            q, weights, k, tokens, tokens, count=count, options=options
        )
        expected = np.asarray(jax.lax.top_k(dense, count)[0])
        scores = np.asarray(selection.scores)
        assert np.array_equal(np.isinf(scores), np.isinf(expected)), (count, block_q)
        np.testing.assert_allclose(np.where(np.isinf(scores), 0, scores), np.where(np.isinf(expected), 0, expected))
        chosen = np.take_along_axis(np.asarray(dense), np.asarray(selection.selected), -1)
        np.testing.assert_allclose(chosen[np.isfinite(scores)], scores[np.isfinite(scores)], rtol=1e-6)
        selected, valid = np.asarray(selection.selected).reshape(-1, count), np.isfinite(scores).reshape(-1, count)
        assert all(len(set(row[seen])) == seen.sum() for row, seen in zip(selected, valid, strict=True))  # no key twice


def test_equal_scores_select_the_earliest_keys_in_any_layout():
    """Scores with many ties (small integers): the selection is the same set of global keys whether the row is in
    original order or in a dual-chunk order, and the earliest keys of a tie."""
    rng = np.random.default_rng(5)
    q, k = (jnp.asarray(rng.integers(0, 2, size=shape), jnp.float32) for shape in ((1, LENGTH, 2, 4), (1, LENGTH, 4)))
    weights = jnp.ones((1, LENGTH, 2), jnp.float32)
    _, order, _ = layouts()["one-document-reordered"]
    chosen = {}
    for name, index in (("original", np.arange(LENGTH)), ("reordered", order)):
        tokens = Tokens(jnp.ones((1, LENGTH), jnp.int32), jnp.asarray(index, jnp.int32))
        laid = lambda x, index=index: x[:, index]
        options = Options(causal=True, block_q=8, block_kv=8)
        selection = top_k(laid(q), laid(weights), laid(k), tokens, tokens, count=5, options=options)
        globals_ = np.where(selection.valid, index[np.asarray(selection.selected)], -1)[0]
        chosen[name] = {int(query): sorted(row) for query, row in zip(index, globals_.tolist(), strict=True)}
    assert chosen["original"] == chosen["reordered"]
    dense = np.asarray(index_scores(q, weights, k))[0]
    for query, keys in chosen["original"].items():
        seen = dense[query, : query + 1]
        ranked = sorted(range(query + 1), key=lambda key: (-seen[key], key))[:5]  # best first, ties by index
        assert {key for key in keys if key >= 0} == set(ranked), query


def test_top_k_refuses_a_count_beyond_the_keys():
    q, weights, k = indexer_inputs()
    with pytest.raises(ValueError, match="top-k count 41: give 1 to the 40 keys"):
        top_k(q, weights, k, Tokens(jnp.ones((BATCH, LENGTH), jnp.int32)), Tokens(), count=41, options=Options())


def dense_attention(q, k, v, allowed, scale):
    """Explicit-mask reference: allowed [batch, tq, tk] -> (out [batch, tq, heads, dv], probabilities summed over
    heads [batch, tq, tk])."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * scale
    scores = jnp.where(allowed[:, None], scores, -jnp.inf)
    total = jax.nn.logsumexp(scores, axis=-1, keepdims=True)
    p = jnp.where(allowed[:, None], jnp.exp(scores - jnp.where(jnp.isfinite(total), total, 0.0)), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest"), p.sum(1)


@pytest.mark.parametrize("count", [3, 12])  # fewer keys than most documents have, and more than some
@pytest.mark.parametrize("heads, kv_heads, dqk, dv", [(4, 2, 16, 16), (4, 1, 24, 16)])  # GQA; MLA's absorbed form
def test_sparse_attention_matches_masked_dense_attention(count, heads, kv_heads, dqk, dv):
    """Packed rows with documents starting mid-block and an all-padding row (zeros, no NaN); float32 outputs and
    gradients within 2e-5."""
    segment_ids, index, _ = layouts()["packed"]
    tokens = Tokens(jnp.asarray(segment_ids), jnp.asarray(index, jnp.int32))
    selection = top_k(*indexer_inputs(seed=1), tokens, tokens, count=count, options=Options(block_q=16, block_kv=16))
    rows = jnp.arange(BATCH)[:, None, None], jnp.arange(LENGTH)[None, :, None]
    allowed = jnp.zeros((BATCH, LENGTH, LENGTH), bool).at[(*rows, selection.selected)].max(selection.valid)
    rng = np.random.default_rng(2)
    q, k = normal(rng, BATCH, LENGTH, heads, dqk), normal(rng, BATCH, LENGTH, kv_heads, dqk)
    v, cotangent = normal(rng, BATCH, LENGTH, kv_heads, dv), normal(rng, BATCH, LENGTH, heads, dv)
    scale = 0.3

    def sparse(q, k, v):
        out, weights = attention(q, k, v, selection, scale=scale, block_q=16)
        return jnp.sum(out * cotangent), (out, weights)

    def dense(q, k, v):
        out, weights = dense_attention(q, k, v, allowed, scale)
        return jnp.sum(out * cotangent), (out, jnp.take_along_axis(weights, selection.selected, -1))

    grads, (out, weights) = jax.jit(jax.grad(sparse, (0, 1, 2), has_aux=True))(q, k, v)
    expected_grads, (expected_out, expected_weights) = jax.grad(dense, (0, 1, 2), has_aux=True)(q, k, v)
    assert relative_error(out, expected_out) < 2e-5
    assert not np.asarray(out[-1]).any()  # the padding row
    np.testing.assert_allclose(weights * selection.valid, expected_weights * selection.valid, atol=1e-6)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert not np.isnan(np.asarray(grad)).any() and relative_error(grad, expected) < 2e-5


def test_selection_of_every_visible_key_is_dense_attention():
    """count = the whole row: sparse attention is causal attention within documents."""
    segment_ids, index, _ = layouts()["packed"]
    tokens = Tokens(jnp.asarray(segment_ids), jnp.asarray(index, jnp.int32))
    selection = top_k(*indexer_inputs(), tokens, tokens, count=LENGTH, options=Options(block_q=8, block_kv=8))
    rng = np.random.default_rng(4)
    q, k, v = (normal(rng, BATCH, LENGTH, 2, 8) for _ in range(3))
    out, _ = attention(q, k, v, Selection(*selection), scale=0.5, block_q=8)
    expected, _ = dense_attention(q, k, v, dense_mask(tokens.segment_ids, tokens.index, None), 0.5)
    assert relative_error(out, expected) < 2e-5


def test_values_that_are_the_keys_first_features_match_them_given_apart():
    """MLA's absorbed form: v given as a width (the keys' first features, gathered once with them) equals v given as
    the keys' slice, in out, the head-summed probabilities and the gradients of q and k."""
    segment_ids, index, _ = layouts()["packed"]
    tokens = Tokens(jnp.asarray(segment_ids), jnp.asarray(index, jnp.int32))
    selection = top_k(*indexer_inputs(seed=3), tokens, tokens, count=6, options=Options(block_q=16, block_kv=16))
    rng = np.random.default_rng(6)
    q, k, cotangent = (
        normal(rng, BATCH, LENGTH, 4, 24),
        normal(rng, BATCH, LENGTH, 1, 24),
        normal(rng, BATCH, LENGTH, 4, 16),
    )

    def run(q, k, shared):
        out, weights = attention(q, k, 16 if shared else k[..., :16], selection, scale=0.3, block_q=16)
        return jnp.sum(out * cotangent), (out, weights)

    (grads, (out, weights)), (want_grads, (want_out, want_weights)) = (
        jax.jit(jax.grad(run, (0, 1), has_aux=True), static_argnums=2)(q, k, shared) for shared in (True, False)
    )
    assert relative_error(out, want_out) < 1e-6 and relative_error(weights, want_weights) < 1e-6
    for grad, want in zip(grads, want_grads, strict=True):
        assert relative_error(grad, want) < 1e-6
