"""The halo exchange of windowed context parallelism: each device receives exactly the keys its windows reach outside
its own piece (a brute-force count over every layout, device count and window), and the compiled ring and all_gather
send only those, forward and backward: the collective-permute bytes of the program (loops counted by trip count)
are the design's, shrink with the window, stay within 2 / (cp - 1) of the full ring's while W - 1 fits a chunk, and
no all-gather of keys remains."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import parallel
from bench.collectives import sent, total_bytes
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import layout_index
from parallel.segments import INT32_MAX
from parallel.strategies import halo

LENGTH, CP, HEADS, KV_HEADS, DIM = 512, 8, 4, 2, 16
CHUNK = LENGTH // (2 * CP)


def needed(index: np.ndarray, shards: int, window: int) -> list[set[int]]:
    """Per device, by brute force: the global indices outside its piece some query of its piece sees."""
    pieces = index.reshape(shards, -1)
    return [{j for i in piece for j in range(max(0, i - window + 1), i + 1)} - set(piece.tolist()) for piece in pieces]


@pytest.mark.parametrize("layout", ["contiguous", "dual_chunk", "striped"])
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_each_device_receives_exactly_what_its_windows_reach(layout, shards):
    length = 64
    index = layout_index(length, shards, layout, stripe=2)
    piece = length // shards
    for window in (1, 5, 16, piece, piece + 3, 3 * piece, length + 1):
        found = halo.shifts(index, shards, window)
        want = needed(index, shards, window)
        if found is None:  # only when the halo is no smaller than the other pieces
            owner = {g: r for r, p in enumerate(index.reshape(shards, -1).tolist()) for g in p}
            widths = [
                max(sum(owner[g] == (r - d) % shards for g in want[r]) for r in range(shards)) for d in range(1, shards)
            ]
            assert sum(widths) >= (shards - 1) * piece, (layout, shards, window)
            continue
        got = [set() for _ in range(shards)]
        for shift in found:
            for source, target in shift.pairs:
                received = shift.index[target][shift.index[target] < INT32_MAX]
                sent_rows = shift.rows[source][: len(received)]
                assert (index.reshape(shards, -1)[source][sent_rows] == received).all(), (layout, shards, window)
                got[target] |= set(received.tolist())
        assert got == want, (layout, shards, window)
        assert sum(s.rows.shape[1] for s in found) < (shards - 1) * piece


def test_dual_chunk_halo_is_two_permutes_of_w_minus_one_tokens():
    index = layout_index(LENGTH, CP, "dual_chunk")
    found = halo.shifts(index, CP, CHUNK + 1)
    assert [s.rows.shape[1] for s in found] == [CHUNK, CHUNK]
    assert sorted(len(s.pairs) for s in found) == [CP - 1, CP - 1]  # the middle rank's chunks are neighbours
    contiguous = halo.shifts(np.arange(LENGTH), CP, CHUNK + 1)
    assert [(s.rows.shape[1], len(s.pairs)) for s in contiguous] == [(CHUNK, CP - 1)]
    assert halo.shifts(index, CP, None) is None and halo.shifts(index, CP, LENGTH) is None


@functools.cache
def compiled_program(strategy: str, window: int | None) -> str:
    """The compiled text of the gradient of sum(attention) in q, k, v on CP devices, dual_chunk, one document."""
    mesh = Mesh(np.array(jax.devices()[:CP]), ("context",))
    q = jax.ShapeDtypeStruct((1, LENGTH, HEADS, DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, LENGTH, KV_HEADS, DIM), jnp.float32)

    def loss(q, k, v):
        out = parallel.attention(q, k, v, window=window, strategy=strategy, axis="context", layout="dual_chunk")
        return jnp.sum(out)

    with jax.set_mesh(mesh), use_parallelism(Parallelism(block_q=32, block_kv=32)):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile().as_text()


def test_ring_sends_only_the_halo():
    full = total_bytes(compiled_program("ring", None))
    index = layout_index(LENGTH, CP, "dual_chunk")
    token = KV_HEADS * DIM * 4  # bytes of one token's keys (or values) in float32
    previous = 0
    for window in (1, 16, CHUNK + 1, 6 * CHUNK):
        program = compiled_program("ring", window)
        widths = sum(s.rows.shape[1] for s in halo.shifts(index, CP, window))
        # forward: K, V and segment ids of each halo row; backward: dK, dV of each (home again)
        assert total_bytes(program) == widths * (4 * token + 4), (window, sent(program))
        assert total_bytes(program) >= previous, window
        previous = total_bytes(program)
        if window - 1 <= CHUNK:
            assert total_bytes(program) <= 2 / (CP - 1) * full, (window, total_bytes(program), full)
    assert previous < full


def test_all_gather_with_a_window_gathers_no_keys():
    program = compiled_program("all_gather", 16)
    assert total_bytes(program, "all-gather") < LENGTH * 4, sent(program, "all-gather")  # at most segment ids
    assert total_bytes(program) == total_bytes(compiled_program("ring", 16))
