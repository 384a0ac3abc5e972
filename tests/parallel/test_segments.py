"""Segment bookkeeping against O(T²) explicit-mask references on random packings."""

import functools

import jax
import numpy as np
import pytest

from parallel.segments import block_summary, full_blocks, seqlens_offsets, visible_blocks


def packed_row(rng, length, max_docs, *, middle_padding=True, trailing_padding=True):
    """Random packing: ([T] segment ids, [T] per-document positions), ids 1.. in order, 0 = padding."""
    seg = np.zeros(length, np.int32)
    pos = np.zeros(length, np.int32)
    end = length - (rng.integers(0, length // 4) if trailing_padding else 0)
    start, doc = 0, 1
    while start < end and doc <= max_docs:
        if middle_padding and doc > 1 and rng.random() < 0.3:
            start += rng.integers(1, 6)
        stop = end if doc == max_docs else min(end, start + rng.integers(1, length // 3))
        if start < stop:
            seg[start:stop] = doc
            pos[start:stop] = np.arange(stop - start)
        start, doc = stop, doc + 1
    return seg, pos


def packed_batch(rng, batch, length, max_docs, **kwargs):
    """[batch, T] segment ids and positions from `packed_row`."""
    rows = [packed_row(rng, length, max_docs, **kwargs) for _ in range(batch)]
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def visibility(q_seg, kv_seg):
    """[Tq, Tk] explicit padding-mask visibility of one row: same segment, not padding."""
    return (q_seg[:, None] == kv_seg[None, :]) & (q_seg[:, None] > 0)


def reference(q_seg, kv_seg, max_segments):
    """O(T²) numpy seqlens_offsets for [batch, T] inputs."""
    out = np.zeros((4, q_seg.shape[0], max_segments), np.int32)
    for b in range(q_seg.shape[0]):
        vis = visibility(q_seg[b], kv_seg[b])
        for kind, seg, seen in ((0, q_seg[b], vis.any(1)), (1, kv_seg[b], vis.any(0))):
            for s in range(1, max_segments + 1):
                hits = np.flatnonzero(seen & (seg == s))
                out[kind, b, s - 1] = len(hits)
                out[kind + 2, b, s - 1] = hits[0] if len(hits) else -1
    return tuple(out)


def rank_pieces(length, ranks):
    """Zigzag load balancing: rank r holds chunks r and 2·ranks−1−r -> [ranks, T / ranks] token indices."""
    chunks = np.arange(length).reshape(2 * ranks, -1)
    return np.stack([np.concatenate([chunks[r], chunks[2 * ranks - 1 - r]]) for r in range(ranks)])


jit_seqlens = jax.jit(seqlens_offsets, static_argnames=("max_segments",))


def check(q_seg, kv_seg, max_segments):
    got = jit_seqlens(q_seg, kv_seg, max_segments=max_segments)
    want = reference(q_seg, kv_seg, max_segments)
    for name, g, w in zip(("q_seqlens", "kv_seqlens", "q_offsets", "kv_offsets"), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
        assert g.dtype == np.int32 and g.shape == w.shape


def test_seqlens_offsets_same_row():
    seg, _ = packed_batch(np.random.default_rng(0), 4, 96, 8)
    check(seg, seg, 8)


def test_seqlens_offsets_rank_pieces():
    seg, _ = packed_batch(np.random.default_rng(1), 3, 128, 6)
    pieces = rank_pieces(128, 4)
    for qr, kr in ((0, 3), (3, 0), (1, 2), (2, 2)):
        check(seg[:, pieces[qr]], seg[:, pieces[kr]], 6)


def test_seqlens_offsets_different_lengths():
    seg, _ = packed_batch(np.random.default_rng(2), 3, 120, 7)
    for q, k in ((slice(10, 50), slice(0, 100)), (slice(0, 120), slice(60, 84)), (slice(90, 120), slice(5, 41))):
        check(seg[:, q], seg[:, k], 7)


def test_seqlens_offsets_all_padding():
    seg = np.zeros((2, 32), np.int32)
    seg[1, 3:20] = 2
    q_len, kv_len, q_off, kv_off = jit_seqlens(seg, seg, max_segments=3)
    for a in (q_len, kv_len):
        np.testing.assert_array_equal(a, [[0, 0, 0], [0, 17, 0]])
    for a in (q_off, kv_off):
        np.testing.assert_array_equal(a, [[-1, -1, -1], [-1, 3, -1]])
    check(seg, seg, 3)


def test_seqlens_offsets_ids_above_max_are_padding():
    seg = np.array([[1, 1, 5, 5, 2, 2]], np.int32)
    clean = np.where(seg > 2, 0, seg)
    got = seqlens_offsets(seg, seg, max_segments=2)
    want = seqlens_offsets(clean, clean, max_segments=2)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def block_reference(q_seg, kv_seg, q_index, kv_index, block, causal, reduce=np.any):
    """[batch, nq, nk] brute force: does the block pair hold a visible (query, key) pair under global indices?
    (reduce=np.all: are all its pairs visible?)"""
    vis = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] > 0)
    if causal:
        vis &= q_index[None, :, None] >= kv_index[None, None, :]
    batch, tq, tk = vis.shape
    return reduce(vis.reshape(batch, tq // block, block, tk // block, block), axis=(2, 4))


@functools.partial(jax.jit, static_argnames=("block", "causal"))
def jit_visible(q_seg, kv_seg, q_index, kv_index, block, causal):
    return visible_blocks(block_summary(q_seg, q_index, block), block_summary(kv_seg, kv_index, block), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_visible_blocks_conservative_under_permutation(causal):
    rng = np.random.default_rng(3)
    seg, _ = packed_batch(rng, 3, 128, 9)
    for trial in range(4):
        order = rng.permutation(128) if trial % 2 else rank_pieces(128, 4).reshape(-1)
        pieces = order.reshape(4, 32)
        for qr, kr in ((0, 1), (2, 2), (3, 0)):
            q, k = pieces[qr], pieces[kr]
            for block in (4, 8):
                got = np.asarray(jit_visible(seg[:, q], seg[:, k], q, k, block, causal))
                want = block_reference(seg[:, q], seg[:, k], q, k, block, causal)
                assert got.shape == want.shape
                assert not (want & ~got).any()


@pytest.mark.parametrize("causal", [False, True])
def test_visible_blocks_exact_for_contiguous_monotone(causal):
    rng = np.random.default_rng(4)
    seg, _ = packed_batch(rng, 4, 128, 12, middle_padding=False)
    index = np.arange(128)
    for block in (4, 16):
        got = np.asarray(jit_visible(seg, seg, index, index, block, causal))
        np.testing.assert_array_equal(got, block_reference(seg, seg, index, index, block, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_full_blocks_exact(causal):
    """full_blocks is True exactly where every pair of the block pair is visible: pieces of a load-balanced
    layout and random orders, documents longer than a block (so full pairs exist), padding in the middle."""
    rng = np.random.default_rng(5)
    seg, _ = packed_batch(rng, 3, 128, 3)
    found = 0
    for trial in range(4):
        orders = (np.arange(128), np.arange(128), rank_pieces(128, 4).reshape(-1), rng.permutation(128))
        order = orders[trial]
        pieces = order.reshape(4, 32)
        for qr, kr in ((0, 0), (2, 1), (3, 0)):
            q, k = pieces[qr], pieces[kr]
            for block in (4, 8):
                summary_q, summary_k = block_summary(seg[:, q], q, block), block_summary(seg[:, k], k, block)
                got = np.asarray(full_blocks(summary_q, summary_k, causal=causal))
                want = block_reference(seg[:, q], seg[:, k], q, k, block, causal, reduce=np.all)
                np.testing.assert_array_equal(got, want)
                found += int(want.sum())
    assert found > 0


def test_block_summary_reductions():
    seg = np.array([[0, 3, 2, 0, 0, 0, 1, 1]], np.int32)
    summary = block_summary(seg, np.array([5, 1, 7, 0, 2, 4, 6, 3]), 4)
    np.testing.assert_array_equal(summary.seg_min, [[2, 1]])
    np.testing.assert_array_equal(summary.seg_max, [[3, 1]])
    np.testing.assert_array_equal(summary.index_min, [0, 2])
    np.testing.assert_array_equal(summary.index_max, [7, 6])
    np.testing.assert_array_equal(summary.padded, [[True, True]])
    np.testing.assert_array_equal(block_summary(seg[:, 4:], np.arange(4), 2).padded, [[True, False]])
    empty = block_summary(np.zeros((1, 4), np.int32), np.arange(4), 2)
    np.testing.assert_array_equal(empty.seg_min, [[np.iinfo(np.int32).max] * 2])
    np.testing.assert_array_equal(empty.seg_max, [[0, 0]])


def test_block_summary_rejects_ragged_length():
    with pytest.raises(ValueError, match=r"10.*4"):
        block_summary(np.ones((1, 10), np.int32), np.arange(10), 4)
