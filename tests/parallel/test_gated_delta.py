"""The chunked gated delta rule equals the token-by-token recurrence, and the row split over context devices
(parallel/recurrent.py) equals one device, outputs and gradients, float32: several chunk counts, documents starting
mid-chunk and across pieces and devices, padding, key heads repeated to value heads. In float64 the split equals one
device to 1e-10: what float32 leaves between them (up to 2e-5 here, 1e-4 in a model's gradients) is rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel
from parallel.kernels import gated_delta
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import from_balanced, to_balanced
from tests.parallel.attention_reference import packed_segments, relative_error
from tests.parallel.gated_delta_reference import recurrence
from tests.parallel.test_strategies import mesh_for

TOLERANCE = 2e-5
FLOOR = {(4, "contiguous"), (8, "dual_chunk")}  # the ring cases the floor stack runs (the others: newest_stack)


def inputs(batch, length, key_heads, heads, dk, dv, seed=0, dtype=jnp.float32):
    """(q, k, v, g, beta) as Gated DeltaNet makes them: q, k L2-normalised (q scaled by dk ** -0.5) on `key_heads`
    heads repeated to `heads`, g = -exp(A) softplus(.) log decays, beta in (0, 1)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    repeat = lambda x: jnp.repeat(x, heads // key_heads, axis=2)
    q = repeat(unit(normal(batch, length, key_heads, dk))) * dk**-0.5
    k = repeat(unit(normal(batch, length, key_heads, dk)))
    g = -jnp.exp(normal(1, 1, heads)) * jax.nn.softplus(normal(batch, length, heads))
    return q, k, normal(batch, length, heads, dv), g, jax.nn.sigmoid(normal(batch, length, heads))


def grads(f, args, seed=1):
    """(f(*args), d<f(*args), w>/d args) for a fixed random cotangent w."""
    out, vjp = jax.vjp(f, *args)
    w = jnp.asarray(np.random.default_rng(seed).normal(size=out.shape), out.dtype)
    return out, vjp(w)


def assert_close(actual, expected, tolerance=TOLERANCE):
    (out, dargs), (out_ref, dargs_ref) = actual, expected
    assert relative_error(out, out_ref) <= tolerance
    names = ("q", "k", "v", "g", "beta", "weight")[: len(dargs)]
    for name, d, d_ref in zip(names, dargs, dargs_ref, strict=True):
        assert relative_error(d, d_ref) <= tolerance, (name, relative_error(d, d_ref))


SEGMENTS = {
    "one document": lambda batch, length: np.ones((batch, length), np.int32),
    "mid-chunk starts": lambda batch, length: np.repeat(np.arange(1, 4), [37, 45, length - 82])[None].repeat(batch, 0),
    "packed": lambda batch, length: packed_segments(batch, length, seed=3),
}


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("segments", list(SEGMENTS))
def test_chunks_equal_the_recurrence(chunk, segments):
    batch, length = 2, 150  # 150 is no multiple of the chunk: the last chunk is padded
    args = inputs(batch, length, key_heads=2, heads=4, dk=16, dv=8)
    seg = jnp.asarray(SEGMENTS[segments](batch, length))
    zero = jnp.zeros((batch, 4, 16, 8))
    start = jnp.full((batch,), -1, jnp.int32)
    chunked = lambda *a: gated_delta.chunked(*a, seg, state=zero, start_seg=start, chunk=chunk)[0]
    assert_close(grads(chunked, args), grads(lambda *a: recurrence(*a, seg), args))


def test_a_piece_continues_from_the_map_of_the_pieces_before():
    """A piece's map [M | E] is its end state as a function of its start state, and the second half of a row run
    from the first half's E equals the row's second half."""
    batch, length, cut = 2, 128, 80
    q, k, v, g, beta = inputs(batch, length, key_heads=1, heads=2, dk=8, dv=4)
    seg = jnp.asarray(SEGMENTS["packed"](batch, length))
    first, second = (lambda x: x[:, :cut]), (lambda x: x[:, cut:])
    maps = gated_delta.affine_map(*map(first, (k, v, g, beta, seg)), start_seg=seg[:, 0], chunk=16)
    m, e = maps[..., :8], maps[..., 8:]
    start = jnp.asarray(np.random.default_rng(2).normal(size=e.shape), jnp.float32)
    _, end = gated_delta.chunked(*map(first, (q, k, v, g, beta, seg)), state=start, start_seg=seg[:, 0], chunk=16)
    assert relative_error(m @ start + e, end) <= TOLERANCE
    out, _ = gated_delta.chunked(*map(second, (q, k, v, g, beta, seg)), state=e, start_seg=seg[:, cut - 1], chunk=16)
    assert relative_error(out, recurrence(q, k, v, g, beta, seg)[:, cut:]) <= TOLERANCE


@pytest.mark.parametrize(
    "strategy,shards,layout",
    [
        *(
            pytest.param("ring", shards, layout, marks=[] if (shards, layout) in FLOOR else [pytest.mark.newest_stack])
            for shards in (2, 4, 8)
            for layout in ("contiguous", "dual_chunk")
        ),
        ("all_gather", 4, "dual_chunk"),
        ("ulysses", 8, "contiguous"),
        ("usp", 8, "dual_chunk"),
        ("none", 4, "dual_chunk"),
    ],
)
def test_split_rows_equal_one_device(strategy, shards, layout, dtype=jnp.float32, tolerance=TOLERANCE):
    """The row split over `shards` devices in `layout` equals the recurrence on one device, convolution included:
    row 0 one document longer than a device's piece, row 1 packed, documents crossing pieces and devices."""
    batch, length, taps = 2, 128, 4
    mesh, axis, layout_shards = mesh_for(strategy, shards)
    weight = jnp.asarray(np.random.default_rng(5).normal(size=(taps, 4, 8)), dtype)
    args = (*inputs(batch, length, key_heads=2, heads=4, dk=8, dv=8, seed=shards, dtype=dtype), weight)
    rows = np.stack([np.ones(length, np.int32), packed_segments(batch, length, seed=shards)[0]])
    seg = jnp.asarray(rows)
    order = dict(layout=layout, axis=1)
    to_layout = lambda x: to_balanced(x, layout_shards, **order)
    parallelism = Parallelism(strategy=strategy, axis=axis, layout=layout, mesh=mesh)

    def split(q, k, v, g, beta, weight):
        with use_parallelism(parallelism):
            (v,) = parallel.causal_conv((to_layout(v),), (weight,), to_layout(seg))
            out = parallel.gated_delta(*map(to_layout, (q, k)), v, *map(to_layout, (g, beta, seg)), chunk=8)
        return from_balanced(out, layout_shards, **order)

    def one_device(q, k, v, g, beta, weight):
        return recurrence(q, k, conv_reference(v, weight, rows), g, beta, seg)

    with jax.set_mesh(mesh):
        actual = grads(jax.jit(split), args)
    assert_close(actual, grads(jax.jit(one_device), args), tolerance)


@pytest.mark.newest_stack
def test_split_rows_equal_one_device_to_float64_rounding():
    """The same in float64 (the kernel computes in its inputs' precision): ring over 8 devices, dual_chunk."""
    with jax.enable_x64(True):
        test_split_rows_equal_one_device("ring", 8, "dual_chunk", dtype=jnp.float64, tolerance=1e-10)


def conv_reference(x, weight, seg):
    """The causal depthwise convolution token by token: out[t] = sum_j weight[j] x[t - taps + 1 + j] over the taps in
    t's document (a change of segment id starts one)."""
    taps, length = weight.shape[0], x.shape[1]
    starts = np.concatenate([np.ones((seg.shape[0], 1), bool), np.asarray(seg[:, 1:] != seg[:, :-1])], axis=1)
    run = np.cumsum(starts, axis=1)
    out = jnp.zeros_like(x)
    for j in range(taps):
        shift = taps - 1 - j
        shifted = jnp.pad(x, [(0, 0), (shift, 0), (0, 0), (0, 0)])[:, :length]
        same = np.concatenate([np.zeros((seg.shape[0], shift), bool), run[:, shift:] == run[:, : length - shift]], 1)
        out = out + jnp.where(jnp.asarray(same)[..., None, None], shifted, 0) * weight[j]
    return out
