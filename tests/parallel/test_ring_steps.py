"""The ring's static step shapes against the truth: for every rank and every other rank's piece, the pairs a step's
call sees are exactly the (query, key) pairs that causality leaves visible; and under cuDNN each dual_chunk step
is one call of a kind it serves."""

from __future__ import annotations

import numpy as np
import pytest

from parallel.kernels import packed
from parallel.reorder import layout_index
from parallel.strategies.ring_steps import step_shapes


def seen(shape, n: int) -> np.ndarray:
    """[n, n] bool: the (query, key) positions a step of `shape` (None: no call) attends."""
    pairs = np.zeros((n, n), bool)
    if shape is not None:
        block = shape.kv_index[None, :] <= shape.q_index[:, None] if shape.causal else True
        pairs[shape.queries, shape.keys] = block
    return pairs


@pytest.mark.parametrize("layout, stripe", [("dual_chunk", 1), ("contiguous", 1), ("striped", 1), ("striped", 2)])
@pytest.mark.parametrize("shards", [2, 4])
def test_step_shapes_see_what_causality_allows(layout, stripe, shards):
    n = 8
    table = layout_index(shards * n, shards, layout, stripe).reshape(shards, n)
    lower, higher = step_shapes(layout, n, stripe, causal=True)
    for rank in range(shards):
        for source in set(range(shards)) - {rank}:
            truth = table[source][None, :] <= table[rank][:, None]
            got = seen(lower if source < rank else higher, n)
            np.testing.assert_array_equal(got, truth, err_msg=f"{layout} rank {rank} source {source}")
    assert all(seen(shape, n).all() for shape in step_shapes(layout, n, stripe, causal=False))


def test_dual_chunk_steps_are_one_all_visible_cudnn_call():
    """Each half step's rows of the real global indices are a call cuDNN serves whole: all-visible."""
    n, shards = 8, 4
    table = layout_index(shards * n, shards, "dual_chunk").reshape(shards, n)
    lower, higher = step_shapes("dual_chunk", n, 1, causal=True)
    for rank, source, shape in ((2, 1, lower), (1, 2, higher)):
        q_index, kv_index = table[rank][shape.queries], table[source][shape.keys]
        assert packed.call_kind(q_index, kv_index, True) == packed.ALL_VISIBLE
    assert (lower.queries, lower.keys) == (slice(0, n), slice(0, n // 2))
    assert (higher.queries, higher.keys) == (slice(n // 2, n), slice(0, n))
