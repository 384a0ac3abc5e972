"""The blockwise kernel equals explicit-mask attention in outputs, log-sum-exp and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels
from parallel.kernels import Options, Tokens
from parallel.kernels.blockwise import SKIP, pad_keys, padded_blocks, pair_kinds
from parallel.segments import block_summary, visible_blocks
from tests.parallel.attention_reference import packed_segments, reference, relative_error

HEADS = {"mha": (4, 4, 16, 16), "gqa": (4, 2, 16, 16), "mla": (2, 2, 24, 16)}  # heads, kv heads, dqk, dv


def inputs(heads, kv_heads, dqk, dv, batch=3, length=40, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(batch, length, heads, dqk), (batch, length, kv_heads, dqk), (batch, length, kv_heads, dv)]
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


@pytest.mark.parametrize("heads", list(HEADS))
def test_kernel_matches_reference(heads):
    """Outputs, lse and gradients through both (dlse too) for causal/full x packed/unpacked, blocks not dividing
    the length, and a fully padded row (zeros, lse -inf, no NaN)."""
    q, k, v = inputs(*HEADS[heads])
    seg = jnp.asarray(packed_segments(3, 40))
    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.normal(size=(3, 40, q.shape[2], v.shape[-1])), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=(3, 40, q.shape[2])), jnp.float32)
    cases = [(causal, packed) for causal in (True, False) for packed in (True, False)]

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse), (out, lse)

        return f

    def kernel_all(q, k, v):
        results = []
        for causal, packed in cases:
            tokens = Tokens(seg if packed else None)
            options = Options(causal=causal, block_q=16, block_kv=8)
            fn = lambda q, k, v: kernels.attention(q, k, v, tokens, tokens, options, kernel="blockwise")
            results.append(jax.grad(loss(fn), argnums=(0, 1, 2), has_aux=True)(q, k, v))
        return results

    for (causal, packed), (grads, (out, lse)) in zip(cases, jax.jit(kernel_all)(q, k, v), strict=True):
        s = seg if packed else None
        ref_fn = lambda q, k, v: reference(q, k, v, segment_ids=s, causal=causal)
        ref_grads, (ref_out, ref_lse) = jax.grad(loss(ref_fn), argnums=(0, 1, 2), has_aux=True)(q, k, v)
        assert relative_error(out, ref_out) < 2e-5
        assert np.array_equal(np.isinf(lse), np.isinf(ref_lse))
        assert relative_error(jnp.where(jnp.isfinite(lse), lse, 0), jnp.where(jnp.isfinite(ref_lse), ref_lse, 0)) < 2e-5
        for g, r in zip(grads, ref_grads, strict=True):
            assert not np.isnan(np.asarray(g)).any()
            assert relative_error(g, r) < 2e-5
        if packed:
            assert np.all(np.asarray(out[-1]) == 0) and np.all(np.isneginf(np.asarray(lse[-1])))


def test_causal_by_global_index():
    """Reordered pieces: the kernel on permuted q / kv with their global indices equals the reference."""
    q, k, v = inputs(*HEADS["gqa"], batch=2, length=32)
    seg = jnp.asarray(packed_segments(2, 32, seed=3))
    perm = np.random.default_rng(2).permutation(32)
    q_rows, kv_rows = perm[:12], perm[12:]  # a query piece and a key piece, non-contiguous and disjoint

    def attend(q, k, v):
        sides = (Tokens(seg[:, q_rows], jnp.asarray(q_rows)), Tokens(seg[:, kv_rows], jnp.asarray(kv_rows)))
        options = Options(causal=True, block_q=4, block_kv=8)
        return kernels.attention(q[:, q_rows], k[:, kv_rows], v[:, kv_rows], *sides, options, kernel="blockwise")

    out, _ = jax.jit(attend)(q, k, v)
    assert relative_error(out, _reference_subset(q, k, v, seg, q_rows, kv_rows)) < 2e-5


def _reference_subset(q, k, v, seg, q_rows, kv_rows):
    """Explicit attention of queries q_rows to keys kv_rows only, causal by original index."""
    qs, ks, vs = np.asarray(q)[:, q_rows], np.asarray(k)[:, kv_rows], np.asarray(v)[:, kv_rows]
    group = qs.shape[2] // ks.shape[2]
    ks, vs = np.repeat(ks, group, axis=2), np.repeat(vs, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", qs, ks) * qs.shape[-1] ** -0.5
    s = np.asarray(seg)
    mask = (s[:, q_rows, None] == s[:, None, kv_rows]) & (s[:, q_rows, None] > 0)
    mask &= np.asarray(q_rows)[:, None] >= np.asarray(kv_rows)[None, :]
    scores = np.where(mask[:, None], scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    weights = np.where(mask[:, None], np.exp(scores - np.where(np.isfinite(top), top, 0)), 0)
    weights /= np.maximum(weights.sum(-1, keepdims=True), 1e-30)
    return np.einsum("bhqk,bkhd->bqhd", weights, vs)


def test_packed_row_skips_blocks():
    """32 packed documents visit about 1/32 of the block pairs of one causal document (Σ len² vs T²)."""
    length, block, docs = 4096, 32, 32
    index = jnp.arange(length, dtype=jnp.int32)
    packed = jnp.repeat(jnp.arange(1, docs + 1, dtype=jnp.int32), length // docs)[None]
    one_doc = jnp.ones((1, length), jnp.int32)
    count = lambda seg: int(
        visible_blocks(block_summary(seg, index, block), block_summary(seg, index, block), causal=True).sum()
    )
    assert count(one_doc) / count(packed) > 16


@pytest.mark.parametrize("length, block", [(768, 512), (1000, 512), (130, 64), (40, 16), (128, 512), (8192, 512)])
def test_blocks_fit_the_length(length, block):
    """Blocks of at most `block` tokens, as few as that allows, padding under 8 tokens per block."""
    size, count = padded_blocks(length, block)
    assert size <= block and count == -(-length // block)
    assert 0 <= size * count - length < 8 * count


def test_padded_key_block_is_skipped_causally():
    """A length that is not whole blocks: the last key block (real keys 32..39, then padding) is skipped by the
    causal query blocks before it, as if it had no padding."""
    length, block = 40, 16
    size, count = padded_blocks(length, block)
    seg = jnp.pad(jnp.ones((1, length), jnp.int32), ((0, 0), (0, size * count - length)))
    q_index = jnp.pad(jnp.arange(length, dtype=jnp.int32), (0, size * count - length))
    keys = pad_keys(Tokens(jnp.ones((1, length), jnp.int32), jnp.arange(length, dtype=jnp.int32)), size)
    kinds = np.asarray(pair_kinds(Tokens(seg, q_index), keys, size, size, Options(causal=True)))[0]
    assert (kinds[:-1, -1] == SKIP).all() and (kinds[-1] != SKIP).all()
