"""Packed-sequence segment bookkeeping without T×T arrays: block summaries for skipping masked
block pairs, and per-segment visible lengths and offsets via segment-wise reductions."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

INT32_MAX = jnp.iinfo(jnp.int32).max


class BlockSummary(NamedTuple):
    """Segment-id and global-index ranges of each block of a packed row."""

    seg_min: jax.Array  # [batch, num_blocks] int32: smallest non-zero segment id; INT32_MAX if all padding
    seg_max: jax.Array  # [batch, num_blocks] int32: largest segment id; 0 if all padding
    index_min: jax.Array  # [num_blocks] int32: smallest global token index
    index_max: jax.Array  # [num_blocks] int32: largest global token index
    padded: jax.Array  # [batch, num_blocks] bool: some token of the block is padding (id 0)


def block_summary(segment_ids, index, block: int) -> BlockSummary:
    """Summaries of [batch, T] segment ids and [T] global token indices in blocks of `block` tokens."""
    batch, length = segment_ids.shape
    if length % block:
        raise ValueError(f"length {length} is not a multiple of block {block}")
    if index.shape != (length,):
        raise ValueError(f"index shape {index.shape} does not match length {length}")
    seg = segment_ids.astype(jnp.int32).reshape(batch, length // block, block)
    idx = index.astype(jnp.int32).reshape(length // block, block)
    return BlockSummary(
        seg_min=jnp.min(jnp.where(seg > 0, seg, INT32_MAX), axis=-1),
        seg_max=jnp.max(seg, axis=-1),
        index_min=jnp.min(idx, axis=-1),
        index_max=jnp.max(idx, axis=-1),
        padded=jnp.any(seg <= 0, axis=-1),
    )


def may_see(q, kv, *, causal: bool, window: int | None = None):
    """Whether a query block and a key block may hold a visible pair, from their summaries' seg_min, seg_max,
    index_min and index_max (a kernel's scalars, or arrays that broadcast; see visible_blocks)."""
    visible = (q.seg_min <= kv.seg_max) & (kv.seg_min <= q.seg_max)
    if causal:
        visible &= kv.index_min <= q.index_max
    if window is not None:
        visible &= kv.index_max > q.index_min - window
    return visible


def visible_pairs(q, kv, *, causal: bool, window: int | None = None):
    """Which (query, key) pairs are visible, from their `segment_ids` and global `index` (a query and a key side,
    e.g. parallel.kernels.arguments.Tokens, whose arrays broadcast against each other): the same non-zero segment,
    and when causal a key index not above the query's, within the `window`."""
    mask = (q.segment_ids == kv.segment_ids) & (q.segment_ids > 0)
    if causal:
        mask &= kv.index <= q.index
    if window is not None:
        mask &= kv.index > q.index - window
    return mask


def visible_blocks(q: BlockSummary, kv: BlockSummary, *, causal: bool, window: int | None = None) -> jax.Array:
    """[batch, nq, nk] bool: False only when no (query, key) pair of the block pair can be visible (with a `window`
    W, a key j is visible to a query i only when i - W < j <= i)."""
    rows = BlockSummary(q.seg_min[:, :, None], q.seg_max[:, :, None], q.index_min[:, None], q.index_max[:, None], None)
    columns = BlockSummary(kv.seg_min[:, None], kv.seg_max[:, None], kv.index_min, kv.index_max, None)
    return may_see(rows, columns, causal=causal, window=window)


def full_blocks(q: BlockSummary, kv: BlockSummary, *, causal: bool, window: int | None = None) -> jax.Array:
    """[batch, nq, nk] bool: True only when every (query, key) pair of the block pair is visible (both blocks lie
    in one and the same segment, without padding, causally every key precedes every query, and every key lies
    within every query's `window`), so a kernel needs no mask there."""

    def single(s: BlockSummary):
        return ~s.padded & (s.seg_min == s.seg_max)

    full = single(q)[:, :, None] & single(kv)[:, None, :] & (q.seg_min[:, :, None] == kv.seg_min[:, None, :])
    if causal:
        full &= (kv.index_max[None, :] <= q.index_min[:, None])[None]
    if window is not None:
        full &= (kv.index_min[None, :] > q.index_max[:, None] - window)[None]
    return full


def _row_seqlens_offsets(q_seg, kv_seg, num_segments: int):
    """One row: [Tq], [Tk] ids -> four [num_segments - 1] int32 arrays: a query (key) token is visible when its
    segment has a key (query) in the other array."""
    q_has = jax.ops.segment_sum(jnp.ones_like(q_seg), q_seg, num_segments=num_segments) > 0
    kv_has = jax.ops.segment_sum(jnp.ones_like(kv_seg), kv_seg, num_segments=num_segments) > 0
    return (
        *_count_first(kv_has[q_seg] & (q_seg > 0), q_seg, num_segments),
        *_count_first(q_has[kv_seg] & (kv_seg > 0), kv_seg, num_segments),
    )


def _count_first(visible, seg, num_segments: int):
    """[T] visibility and ids -> ([S] count, [S] first index or -1) for ids 1..S."""
    count = jax.ops.segment_sum(visible.astype(jnp.int32), seg, num_segments=num_segments)[1:]
    index = jnp.where(visible, jnp.arange(seg.shape[0], dtype=jnp.int32), INT32_MAX)
    first = jax.ops.segment_min(index, seg, num_segments=num_segments)[1:]
    return count, jnp.where(count > 0, first, -1)


def seqlens_offsets(q_segment_ids, kv_segment_ids, *, max_segments: int):
    """Per-segment token counts and first indices under a padding mask (a query sees every key of its segment;
    cuDNN's ragged layout), in O(T + S) memory per row.

    q_segment_ids: [batch, Tq] int32; kv_segment_ids: [batch, Tk] int32. Returns (q_seqlens, kv_seqlens,
    q_offsets, kv_offsets), each [batch, max_segments] int32, slot s-1 for segment id s: the number of query
    tokens whose segment has a key (keys whose segment has a query), and the index along T of the first such
    token, -1 if none. Id 0 is padding; ids above `max_segments` are a caller error and are treated as padding.
    """
    num_segments = max_segments + 1

    def valid(seg):
        seg = seg.astype(jnp.int32)
        return jnp.where((seg > 0) & (seg < num_segments), seg, 0)

    row = jax.vmap(lambda q, kv: _row_seqlens_offsets(q, kv, num_segments))
    q_len, q_off, kv_len, kv_off = row(valid(q_segment_ids), valid(kv_segment_ids))
    return q_len, kv_len, q_off, kv_off
