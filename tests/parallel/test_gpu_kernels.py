"""On a GPU only (skipped elsewhere): the real cuDNN, FlashAttention-3, tokamax and Pallas (Triton) kernels equal the
blockwise kernel on the same bfloat16 inputs, in out, lse, dq, dk and dv through a loss with a nonzero lse cotangent,
for every kind of call the strategies make: the causal diagonal and a non-causal call, on packed and unpacked rows; keys
that all precede the queries (a ring step), also all in other documents (every packed slot empty); two whole dual_chunk
pieces off the diagonal ("halves": the ring calls each half all-visible, the packed kernels send the whole to their
general kernel, Pallas); striped global indices (the packed kernels: their general kernel, Pallas). MHA, GQA and MLA
head dims; indices static and traced. And tokamax's grouped matmul for the experts equals `ragged_dot`.

    python -m pytest -q tests/parallel/test_gpu_kernels.py
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import grouped, kernels, tokamax_calls
from parallel.kernels import Options, Tokens, flash3, tokamax_attention
from parallel.parallelism import Parallelism, use_parallelism
from parallel.reorder import layout_index
from tests.parallel.attention_reference import packed_segments, relative_error


def first_gpu():
    """The machine's first GPU (tests/conftest.py starts JAX on cpu,cuda where there is one), else None."""
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        return None


GPU = first_gpu()
pytestmark = pytest.mark.skipif(GPU is None, reason="the real kernels need a GPU")

HEADS = {"mha": (8, 8, 64, 64), "gqa": (8, 2, 128, 128), "mla": (8, 8, 192, 128)}  # heads, kv heads, dqk, dv
PIECE = 512  # tokens per call side; a ring's pieces are 4 of these
BLOCKS = dict(block_q=64, block_kv=64)


def call(kind: str, packed: bool):
    """(q_seg, kv_seg [2, PIECE] int32, q_index, kv_index [PIECE] int32 numpy, causal) of one kind of call."""
    if kind == "foreign":  # keys that precede the queries but belong to other documents: nothing visible
        index = np.arange(2 * PIECE, dtype=np.int32)
        ones = np.ones((2, PIECE), np.int32)
        return jnp.asarray(2 * ones), jnp.asarray(ones), index[PIECE:], index[:PIECE], True
    if kind in ("diagonal", "full"):
        seg = packed_segments(2, PIECE, seed=1) if packed else np.ones((2, PIECE), np.int32)
        index = np.arange(PIECE, dtype=np.int32)
        return jnp.asarray(seg), jnp.asarray(seg), index, index, kind == "diagonal"
    layout, (q_rank, kv_rank) = {"preceding": ("contiguous", (1, 0)), "halves": ("dual_chunk", (2, 1))}.get(
        kind, ("striped", (1, 2))
    )
    index = layout_index(4 * PIECE, 4, layout, stripe=16).reshape(4, PIECE)
    full = packed_segments(2, 4 * PIECE, seed=2) if packed else np.ones((2, 4 * PIECE), np.int32)
    q_index, kv_index = index[q_rank], index[kv_rank]
    return jnp.asarray(full[:, q_index]), jnp.asarray(full[:, kv_index]), q_index, kv_index, True


def outputs_and_grads(kernel: str, q, k, v, q_seg, kv_seg, q_index, kv_index, causal: bool, traced: bool):
    """(out, lse, dq, dk, dv) as float32 of a loss through out and lse."""
    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.normal(size=(*q.shape[:3], v.shape[-1])), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)

    def loss(q, k, v, q_index, kv_index):
        sides = (Tokens(q_seg, q_index), Tokens(kv_seg, kv_index))
        out, lse = kernels.attention(q, k, v, *sides, Options(causal=causal, **BLOCKS), kernel=kernel, backend="gpu")
        out32 = out.astype(jnp.float32)
        return jnp.sum(out32 * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse), (out32, lse)

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    if traced:
        grads, (out, lse) = jax.jit(grad)(q, k, v, q_index, kv_index)
    else:
        grads, (out, lse) = jax.jit(lambda q, k, v: grad(q, k, v, q_index, kv_index))(q, k, v)
    return out, lse, *(g.astype(jnp.float32) for g in grads)


@pytest.mark.parametrize("kernel", ["cudnn", "flash3", "tokamax", "pallas"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("kind", ["diagonal", "full", "preceding", "foreign", "halves", "striped"])
def test_kernel_equals_blockwise_on_gpu(kernel, heads, kind):
    """Packed and unpacked rows, indices static and traced (cuDNN from Hopper on)."""
    if kernel == "cudnn" and not kernels.hopper("gpu", None):
        pytest.skip(f"cuDNN's packed rows need compute capability 9.0, not {GPU.compute_capability}")
    if kernel == "flash3" and (kernels.compute_capability("gpu", None)[0] != 9 or flash3.missing()):
        pytest.skip(flash3.missing() or f"FlashAttention-3 runs on Hopper (9.0), not {GPU.compute_capability}")
    if kernel == "tokamax" and (not kernels.hopper("gpu", None) or tokamax_attention.missing()):
        pytest.skip(
            tokamax_attention.missing() or f"tokamax's kernel needs Hopper (9.0+), not {GPU.compute_capability}"
        )
    h, hkv, dqk, dv = HEADS[heads]
    rng = np.random.default_rng(0)
    shapes = [(2, PIECE, h, dqk), (2, PIECE, hkv, dqk), (2, PIECE, hkv, dv)]
    q, k, v = (jax.device_put(jnp.asarray(rng.normal(size=s), jnp.bfloat16), GPU) for s in shapes)
    with jax.default_device(GPU):
        compare_on_gpu(kernel, heads, kind, q, k, v)


def compare_on_gpu(kernel, heads, kind, q, k, v):
    """The kernel against the blockwise kernel for packed and unpacked rows, static and traced indices."""
    for packed, traced in itertools.product([True, False], [False, True]):
        label = f"{kernel} {heads} {kind} packed={packed} traced={traced}"
        case = call(kind, packed)
        got = outputs_and_grads(kernel, q, k, v, *case, traced=traced)
        want = outputs_and_grads("blockwise", q, k, v, *case, traced=traced)
        assert np.array_equal(np.isinf(got[1]), np.isinf(want[1])), f"{label}: tokens with no visible key differ"
        finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
        assert relative_error(finite(got[1]), finite(want[1])) < 1e-2, f"{label}: lse"
        for name, a, b in zip(["out", "dq", "dk", "dv"], (got[0], *got[2:]), (want[0], *want[2:]), strict=True):
            assert not np.isnan(np.asarray(a)).any(), f"{label}: NaN in {name}"
            assert relative_error(a, b) < 3e-2, f"{label}: {name}"


@pytest.mark.skipif(not tokamax_calls.installed(), reason=f"needs tokamax: {tokamax_calls.INSTALL}")
def test_tokamax_grouped_matmul_equals_ragged_dot_on_gpu():
    """The experts' grouped matmul (parallel/grouped.py) by tokamax's kernels equals `ragged_dot` in its output and
    both gradients, on groups of uneven sizes (one empty) that leave padding rows past them."""
    rows, embed, mlp, sizes = 1024, 256, 512, [300, 0, 129, 64, 400]
    rng = np.random.default_rng(0)
    x = jax.device_put(jnp.asarray(rng.normal(size=(rows, embed)), jnp.bfloat16), GPU)
    w = jax.device_put(jnp.asarray(rng.normal(size=(len(sizes), embed, mlp)) / 16, jnp.bfloat16), GPU)
    group_sizes = jax.device_put(jnp.asarray(sizes, jnp.int32), GPU)
    filled = sum(sizes)

    def loss(implementation, x, w):
        with use_parallelism(Parallelism(grouped_matmul=implementation, device=GPU)):
            out = grouped.ragged_dot(x, w, group_sizes)[:filled].astype(jnp.float32)
        return jnp.sum(jnp.sin(out)), out

    got, want = (
        jax.jit(jax.value_and_grad(lambda x, w, i=i: loss(i, x, w), argnums=(0, 1), has_aux=True))(x, w)
        for i in ("tokamax", "xla")
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert relative_error(a, b) < 2e-2
