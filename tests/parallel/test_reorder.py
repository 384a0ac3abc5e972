"""Load-balanced sequence reorder: equal to an index gather, exact inverse, numpy == jax, gather-free HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel.reorder import from_balanced, layout_index, to_balanced

LAYOUTS = [("dual_chunk", 1), ("striped", 1), ("striped", 2)]
LENGTH = 48  # divisible by 2*shards and shards*stripe for every shards below


def reference_perm(length, shards, layout, stripe):
    """Original token index of each balanced position, by loops over ranks from the layout definitions."""
    perm = []
    if layout == "dual_chunk":
        chunk = length // (2 * shards)
        for rank in range(shards):
            for c in (rank, 2 * shards - 1 - rank):
                perm += range(c * chunk, (c + 1) * chunk)
    else:
        for rank in range(shards):
            for start in range(rank * stripe, length, shards * stripe):
                perm += range(start, start + stripe)
    assert sorted(perm) == list(range(length))
    return np.array(perm)


def sample(shape, dtype):
    return jnp.asarray(np.random.default_rng(0).normal(size=shape) * 100, dtype)


def op_names(hlo: str) -> set[str]:
    """Lower-cased instruction op names of compiled HLO text (metadata and names excluded)."""
    return {op.lower() for op in re.findall(r"=\s*\S+\s+([\w-]+)\(", hlo)}


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout,stripe", LAYOUTS)
@pytest.mark.parametrize("axis,dtype", [(0, jnp.float32), (1, jnp.bfloat16), (2, jnp.int32), (-1, jnp.float32)])
def test_matches_gather_and_round_trips(shards, layout, stripe, axis, dtype):
    shape = [3, 5, 2]
    shape[axis] = LENGTH
    x = sample(shape, dtype)
    perm = reference_perm(LENGTH, shards, layout, stripe)
    kwargs = dict(axis=axis, layout=layout, stripe=stripe)
    balanced = to_balanced(x, shards, **kwargs)
    assert balanced.dtype == x.dtype and balanced.shape == x.shape
    np.testing.assert_array_equal(balanced, jnp.take(x, perm, axis=axis))
    np.testing.assert_array_equal(from_balanced(x, shards, **kwargs), jnp.take(x, np.argsort(perm), axis=axis))
    np.testing.assert_array_equal(from_balanced(balanced, shards, **kwargs), x)
    host = np.asarray(x)
    host_balanced = to_balanced(host, shards, **kwargs)
    assert isinstance(host_balanced, np.ndarray)
    np.testing.assert_array_equal(host_balanced, balanced)
    np.testing.assert_array_equal(from_balanced(host, shards, **kwargs), from_balanced(x, shards, **kwargs))
    np.testing.assert_array_equal(layout_index(LENGTH, shards, layout, stripe), perm)


def test_contiguous_is_identity():
    x = np.arange(24).reshape(2, 12)
    assert to_balanced(x, 4, layout="contiguous") is x
    assert from_balanced(x, 4, layout="contiguous") is x


def test_dual_chunk_layout_index():
    index = layout_index(16, 4, "dual_chunk")
    assert index.dtype == np.int32
    np.testing.assert_array_equal(index, [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])


@pytest.mark.parametrize("fn", [to_balanced, from_balanced])
@pytest.mark.parametrize("layout,stripe", [("dual_chunk", 1), ("striped", 2)])
def test_compiled_hlo_has_no_gather_or_loop(fn, layout, stripe):
    x = jnp.zeros((2, 64, 4, 8), jnp.bfloat16)
    hlo = jax.jit(lambda x: fn(x, 8, layout=layout, stripe=stripe)).lower(x).compile().as_text()
    ops = op_names(hlo)
    assert ops and not ops & {"gather", "while"}, sorted(ops)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(shards=4, layout="dual_chunk"),
            "sequence length 100 is not divisible by 2*shards=8 for dual_chunk layout",
        ),
        (dict(shards=3, layout="striped", stripe=2), "sequence length 100 is not divisible by shards*stripe=6"),
        (dict(shards=2, layout="zigzag"), "'zigzag' is unknown; available: contiguous, dual_chunk, striped"),
        (dict(shards=0), "shards=0 must be >= 1"),
        (dict(shards=2, layout="striped", stripe=0), "stripe=0 must be >= 1"),
        (dict(shards=2, axis=3), "axis 3 is out of range"),
    ],
)
def test_bad_arguments(kwargs, message):
    x = np.zeros((2, 100, 3))
    for fn in (to_balanced, from_balanced):
        with pytest.raises(ValueError, match=re.escape(message)):
            fn(x, **kwargs)
