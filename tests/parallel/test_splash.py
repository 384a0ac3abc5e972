"""JAX's TPU splash attention behind the kernel interface (Pallas' interpret mode on CPU) equals the blockwise kernel:
out, lse and the gradients of q, k and v through both (the lse's cotangent included), on every kind of call the
strategies make (the causal diagonal, a ring's full and dual_chunk steps, striped pieces, all_gather's traced queries
against keys in order, windows, non-causal), packed and unpacked, GQA and MLA's widths, lengths that are not whole
blocks and rows that see no key. Behind every strategy (the blockwise kernel poisoned with NaN, so splash serves
every call) it equals the reference, windows and sinks included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels
from parallel.kernels import Options, Tokens, blockwise, splash
from parallel.reorder import layout_index
from tests.parallel.attention_reference import packed_segments, relative_error
from tests.parallel.test_kernels import HEADS, assert_same, inputs
from tests.parallel.test_strategies import check_strategy
from tests.parallel.test_strategy_windows import check_windows


def grads_of(kernel, q, k, v, q_tokens, kv_tokens, options, traced=False):
    """(out, lse, dq, dk, dv) through a loss on both outputs; `traced` passes the query indices as a jit argument."""
    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.normal(size=(*q.shape[:3], v.shape[-1])), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)

    def loss(q, k, v, q_index):
        sides = (q_tokens._replace(index=q_index), kv_tokens)
        out, lse = kernels.attention(q, k, v, *sides, options, kernel=kernel, interpret=True)
        return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse), (out, lse)

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    if traced:
        grads, (out, lse) = jax.jit(grad)(q, k, v, jnp.asarray(q_tokens.index))
    else:
        grads, (out, lse) = jax.jit(lambda q, k, v: grad(q, k, v, q_tokens.index))(q, k, v)
    return out, lse, *grads


PIECES = layout_index(512, 4, "dual_chunk").reshape(4, 128)  # a 4-device dual_chunk ring over 512 tokens
STRIPES = layout_index(512, 4, "striped", stripe=2).reshape(4, 128)
CALLS = {  # name: (q_index, kv_index, causal, window, traced queries)
    "diagonal": (np.arange(200), np.arange(200), True, None, False),
    "full ring step": (PIECES[2], PIECES[1], True, None, False),
    "dual_chunk half": (PIECES[1][64:], PIECES[3], True, None, False),
    "striped pieces": (STRIPES[2], STRIPES[1], True, None, False),
    "queries before every key": (PIECES[0][:64], PIECES[3][:64], True, None, False),
    "all_gather (traced queries)": (PIECES[1], np.arange(512), True, None, True),
    "window": (np.arange(200), np.arange(200), True, 37, False),
    "window, traced queries": (PIECES[2], np.arange(512), True, 150, True),
    "non-causal": (PIECES[2], PIECES[0], False, None, False),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("heads, packed", [("gqa", True), ("mla", False)])
def test_splash_equals_blockwise(call, heads, packed):
    q_index, kv_index, causal, window, traced = CALLS[call]
    q, k, v = inputs(*HEADS[heads], tq=len(q_index), tk=len(kv_index))
    seg = packed_segments(2, 512, seed=2) if packed else np.ones((2, 512), np.int32)
    sides = (Tokens(jnp.asarray(seg[:, q_index]), q_index), Tokens(jnp.asarray(seg[:, kv_index]), kv_index))
    options = Options(causal=causal, window=window, block_q=128, block_kv=128)
    got = grads_of("splash", q, k, v, *sides, options, traced)
    assert_same(got, grads_of("blockwise", q, k, v, *sides, options, traced))


def test_backward_adds_into_running_sums():
    """backward(accumulate=sums) is sums + backward, in the sums' dtypes (a ring step's update)."""
    q, k, v = inputs(*HEADS["gqa"], tq=130, tk=130)
    tokens = Tokens(jnp.asarray(packed_segments(2, 130)), np.arange(130, dtype=np.int32))
    options = Options(scale=0.25, block_q=128, block_kv=128)
    out, lse = blockwise.forward(q, k, v, tokens, tokens, options=options)
    dout = jnp.asarray(np.random.default_rng(2).normal(size=out.shape), jnp.float32)
    args = (q, k, v, tokens, tokens, out, lse, dout, None)
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float32)
    sums = [jnp.ones(x.shape, dtype) for x, dtype in zip((q, k, v), dtypes, strict=True)]
    got = splash.backward(*args, options=options, accumulate=sums, interpret=True)
    fresh = splash.backward(*args, options=options, grad_dtype=jnp.float32, interpret=True)
    for total, g, start in zip(got, fresh, sums, strict=True):
        assert total.dtype == start.dtype
        want = (start.astype(jnp.float32) + g).astype(start.dtype).astype(jnp.float32)
        assert relative_error(total.astype(jnp.float32), want) < (1e-6 if start.dtype == jnp.float32 else 1e-2)


def test_tpus_get_splash_and_a_call_it_cannot_serve_runs_blockwise(caplog):
    assert kernels.select("auto", backend="tpu").name == "splash"
    with pytest.raises(ValueError, match=r"attention kernel 'splash' compiles for TPU .*, not gpu; choose cudnn"):
        kernels.select("splash", backend="gpu", capability="9.0")
    q, k, v = inputs(*HEADS["gqa"], tq=64, tk=64)
    traced = Tokens(jnp.ones((2, 64), jnp.int32), jnp.arange(64, dtype=jnp.int32))  # keys' indices traced
    options = Options(scale=0.25, block_q=128, block_kv=128)
    with caplog.at_level("INFO"):
        got = jax.jit(lambda t: kernels.select("splash", interpret=True).forward(q, k, v, t, t, options=options))(
            traced
        )
    assert "splash attention needs the keys' global indices known at trace time" in caplog.text
    assert "the blockwise kernel runs such calls" in caplog.text
    want = blockwise.forward(q, k, v, traced, traced, options=options)
    assert relative_error(got[0], want[0]) < 1e-6


@pytest.fixture
def only_splash(monkeypatch):
    """The blockwise kernel returns NaN: a call splash does not serve shows."""

    def forward(*args, **kwargs):
        out, lse = blockwise.forward(*args, **kwargs)
        return out * jnp.nan, lse

    def backward(*args, **kwargs):
        return tuple(g * jnp.nan for g in blockwise.backward(*args, **kwargs))

    monkeypatch.setattr(kernels, "BLOCKWISE", kernels.Kernel("blockwise", forward, backward))


@pytest.mark.parametrize(
    "strategy, layout",
    [("ring", "dual_chunk"), ("ring", "striped"), ("all_gather", "dual_chunk"), ("ulysses", "striped"),
     ("usp", "dual_chunk")],
)  # fmt: skip
def test_every_strategy_runs_on_splash(only_splash, strategy, layout):
    check_strategy(strategy, 4, layout, 2, case_list=[("gqa", True), ("mla", False)], kernel="splash")


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_windows_and_sinks_run_on_splash(only_splash, strategy):
    """Windows a halo serves (each rank's calls static, a switch over ranks) and the sinks."""
    check_windows(strategy, 4, "dual_chunk", kernel="splash", windows=(5, 16))
