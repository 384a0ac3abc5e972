"""The Pallas attention kernels (interpret mode on CPU) equal the blockwise kernel: out, lse and the gradients of
q, k and v through both, on packed and unpacked rows, causal and full, MHA / GQA / dqk != dv, the global indices
of each sequence layout (a ring step's pieces), and rows with no visible key; and which kernel a backend gets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels
from parallel.kernels import Options, Tokens, blockwise
from parallel.reorder import layout_index
from tests.parallel.attention_reference import packed_segments, relative_error

HEADS = {"mha": (4, 4, 16, 16), "gqa": (4, 2, 16, 16), "mla": (2, 1, 24, 16)}  # heads, kv heads, dqk, dv
LENGTH = 48  # 3 blocks of 16, the smallest Pallas block


def inputs(heads, kv_heads, dqk, dv, batch=2, tq=LENGTH, tk=LENGTH, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(batch, tq, heads, dqk), (batch, tk, kv_heads, dqk), (batch, tk, kv_heads, dv)]
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def outputs_and_grads(kernel, q, k, v, q_tokens=None, kv_tokens=None, causal=True):
    """(out, lse, dq, dk, dv) of a loss through both outputs (so lse's cotangent reaches the backward)."""
    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.normal(size=(*q.shape[:3], v.shape[-1])), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)

    def loss(q, k, v):
        options = Options(causal=causal, block_q=16, block_kv=16)
        out, lse = kernels.attention(q, k, v, q_tokens, kv_tokens, options, kernel=kernel, interpret=True)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, lse, *grads


def assert_same(pallas, blockwise):
    out, lse = pallas[:2]
    assert np.array_equal(np.isinf(lse), np.isinf(blockwise[1]))
    finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
    assert relative_error(finite(lse), finite(blockwise[1])) < 1e-5
    for got, want in zip((out, *pallas[2:]), (blockwise[0], *blockwise[2:]), strict=True):
        assert not np.isnan(np.asarray(got)).any()
        assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize(
    "heads, causal, packed",
    [("mha", True, True), ("gqa", False, True), ("gqa", True, False), ("mla", True, True), ("mla", False, False)],
)
def test_pallas_equals_blockwise(heads, causal, packed):
    """Lengths that are not whole blocks and a fully padded row (zeros, lse -inf) included."""
    q, k, v = inputs(*HEADS[heads], tq=LENGTH - 4, tk=LENGTH - 4)
    tokens = Tokens(jnp.asarray(packed_segments(2, LENGTH - 4)) if packed else None)
    options = dict(q_tokens=tokens, kv_tokens=tokens, causal=causal)
    assert_same(outputs_and_grads("pallas", q, k, v, **options), outputs_and_grads("blockwise", q, k, v, **options))


@pytest.mark.parametrize("layout, ranks", [("dual_chunk", (1, 1)), ("striped", (2, 0)), ("dual_chunk", (0, 3))])
def test_pallas_equals_blockwise_on_ring_pieces(layout, ranks):
    """A ring step: rank q_rank's queries against rank kv_rank's keys in `layout` for 4 ranks, causal by global
    index; (0, 3) gives queries that precede every key of the piece (no visible key in some rows)."""
    shards, piece = 4, 32
    index = layout_index(shards * piece, shards, layout, stripe=2).reshape(shards, piece)
    q_index, kv_index = (jnp.asarray(index[rank]) for rank in ranks)
    q, k, v = inputs(*HEADS["gqa"], tq=piece, tk=piece)
    seg = jnp.asarray(packed_segments(2, shards * piece, seed=3))
    sides = (Tokens(seg[:, q_index], q_index), Tokens(seg[:, kv_index], kv_index))
    assert_same(outputs_and_grads("pallas", q, k, v, *sides), outputs_and_grads("blockwise", q, k, v, *sides))


@pytest.mark.parametrize("name", ["blockwise", "pallas"])
def test_backward_adds_into_running_sums(name):
    """backward(accumulate=sums) is sums + backward (a ring step's in-place update), in the sums' dtypes, on
    lengths that are not whole blocks."""
    impl = kernels.select(name, interpret=True)
    q, k, v = inputs(*HEADS["mla"], tq=LENGTH - 4, tk=LENGTH - 4)
    seg = jnp.asarray(packed_segments(2, LENGTH - 4))
    tokens = Tokens(seg, jnp.arange(LENGTH - 4, dtype=jnp.int32))
    options = Options(causal=True, scale=0.25, block_q=16, block_kv=16)
    out, lse = impl.forward(q, k, v, tokens, tokens, options=options)
    dout = jnp.asarray(np.random.default_rng(2).normal(size=out.shape), jnp.float32)
    args = (q, k, v, tokens, tokens, out, lse, dout, None)
    sums = [
        jnp.asarray(np.random.default_rng(3).normal(size=x.shape), dtype)
        for x, dtype in zip((q, k, v), (jnp.float32, jnp.bfloat16, jnp.bfloat16), strict=True)
    ]
    got = jax.jit(lambda sums: impl.backward(*args, options=options, accumulate=sums))(sums)
    fresh = impl.backward(*args, options=options, grad_dtype=jnp.float32)
    for total, g, start in zip(got, fresh, sums, strict=True):
        assert total.dtype == start.dtype
        want = (start.astype(jnp.float32) + g).astype(start.dtype).astype(jnp.float32)
        assert relative_error(total.astype(jnp.float32), want) < (1e-6 if start.dtype == jnp.float32 else 1e-2)


def test_each_backend_gets_its_kernel():
    assert kernels.select("auto", backend="gpu", capability="9.0").name == "cudnn"  # Hopper and newer
    assert kernels.select("auto", backend="gpu", capability="10.0").name == "cudnn"
    assert kernels.select("auto", backend="gpu", capability="8.0").name == "pallas"
    assert kernels.select("auto", backend="cpu").name == "blockwise"
    assert kernels.general_kernel("cudnn", "gpu") == "pallas"
    assert kernels.general_kernel("cudnn", "cpu") == "blockwise"  # where only stand-ins run it
    assert kernels.select("pallas", backend="gpu").name == "pallas"
    assert kernels.select("pallas", backend="cpu", interpret=True).name == "pallas"
    with pytest.raises(ValueError, match=r"attention kernel .pallas. compiles for GPU .*, not cpu"):
        kernels.select("pallas", backend="cpu")
    with pytest.raises(ValueError, match="attention kernel 'flash' is unknown; choose one of auto, pallas, blockwise"):
        kernels.select("flash")


def test_an_lse_nothing_reads_reaches_the_backward_as_none():
    """A symbolic zero cotangent: the packed kernels then carry no dlse columns (parallel/kernels/flash3.py)."""
    q, k, v = inputs(*HEADS["gqa"], batch=1, tq=16, tk=16)
    seen = []

    def backward(*args, **kwargs):
        seen.append(args[8])
        return blockwise.backward(*args, **kwargs)

    probe = kernels.Kernel("probe", blockwise.forward, backward)
    for part in (0, 1):
        jax.grad(lambda q, part=part: kernels.attention(q, k, v, kernel=probe)[part].sum())(q)
    assert seen[0] is None and seen[1].shape == (1, 16, 4)
