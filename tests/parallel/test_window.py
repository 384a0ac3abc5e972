"""Sliding windows and attention sinks in the kernels against the dense reference (attention_reference.py: a window
mask, a sink as one more logit column of value zero): out, lse (the keys' only) and the gradients of q, k, v and the
sinks, for the blockwise kernel and the Pallas kernels (interpret mode) at windows from one token to more
than the row, on packed rows in a load-balanced (dual_chunk) order with GQA; and the block pairs the window skips."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels
from parallel.kernels import Options, Tokens, blockwise, cudnn
from parallel.kernels.blockwise import FULL, SKIP, pair_kinds
from parallel.reorder import layout_index
from tests.parallel.attention_reference import packed_segments, reference, relative_error

BATCH, LENGTH, BLOCK = 2, 48, 16  # three blocks of 16, the smallest Pallas block
HEADS, KV_HEADS, DQK, DV = 4, 2, 16, 8
WINDOWS = (1, 5, BLOCK, BLOCK + 3, LENGTH + 7)


def data(seed=0):
    """(q, k, v, cotangent of out, cotangent of lse, sinks) float32."""
    rng = np.random.default_rng(seed)
    shapes = [
        (BATCH, LENGTH, HEADS, DQK),
        (BATCH, LENGTH, KV_HEADS, DQK),
        (BATCH, LENGTH, KV_HEADS, DV),
        (BATCH, LENGTH, HEADS, DV),
        (BATCH, LENGTH, HEADS),
        (HEADS,),
    ]
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def loss(attend, q, k, v, s, w_out, w_lse):
    """A loss through attend(q, k, v, s)'s sunk output and the keys' lse: (loss, (out, lse))."""
    out, lse = attend(q, k, v, s)
    return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse), (out, lse)


def check(got, want, label):
    """got / want: (dq, dk, dv, dsinks), (out, lse)."""
    (grads, (out, lse)), (ref_grads, (ref_out, ref_lse)) = got, want
    assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)), label
    finite = lambda x: jnp.where(jnp.isfinite(x), x, 0.0)
    assert relative_error(finite(lse), finite(ref_lse)) < 1e-5, label
    assert relative_error(out, ref_out) < 1e-5, label
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        assert not np.isnan(np.asarray(g)).any(), f"{label}: NaN in {name}"
        assert relative_error(g, r) < 1e-5, f"{label}: {name}"


@pytest.mark.parametrize("kernel", ["blockwise", "pallas"])
def test_windows_and_sinks_equal_the_reference(kernel):
    """Every window in one compile; the sequence in dual_chunk order for 2 devices (non-contiguous indices)."""
    q, k, v, w_out, w_lse, s = data()
    seg = jnp.asarray(packed_segments(BATCH, LENGTH, seed=3))
    index = layout_index(LENGTH, 2, "dual_chunk")
    back = np.argsort(index)
    tokens = Tokens(seg[:, index], index)

    def kernel_loss(window, q, k, v, s):
        options = Options(block_q=BLOCK, block_kv=BLOCK, window=window)

        def attend(q, k, v, s):
            qkv = (q[:, index], k[:, index], v[:, index])
            out, lse = kernels.attention(*qkv, tokens, tokens, options, sinks=s, kernel=kernel, interpret=True)
            return out[:, back], lse[:, back]

        return loss(attend, q, k, v, s, w_out, w_lse)

    def ref_loss(window, q, k, v, s):
        attend = lambda q, k, v, s: reference(q, k, v, segment_ids=seg, window=window, sinks=s)
        return loss(attend, q, k, v, s, w_out, w_lse)

    def all_windows(f):
        grad = lambda window: jax.grad(lambda *a: f(window, *a), argnums=(0, 1, 2, 3), has_aux=True)
        return jax.jit(lambda *a: [grad(window)(*a) for window in WINDOWS])(q, k, v, s)

    for window, got, want in zip(WINDOWS, all_windows(kernel_loss), all_windows(ref_loss), strict=True):
        check(got, want, f"{kernel} window={window}")


def dense_kinds(q_index, kv_index, window, block):
    """[nq, nk] kind of each block pair from the dense causal window mask of one unpacked row."""
    visible = (kv_index[None, :] <= q_index[:, None]) & (kv_index[None, :] > q_index[:, None] - window)
    pairs = visible.reshape(len(q_index) // block, block, len(kv_index) // block, block).transpose(0, 2, 1, 3)
    return np.where(pairs.all((2, 3)), FULL, np.where(pairs.any((2, 3)), 1, SKIP))


@pytest.mark.parametrize("window", [1, 8, 13, 16, 40])
def test_the_window_skips_whole_block_pairs(window):
    """In original order the block pairs' kinds are the dense mask's exactly (pairs wholly outside the window are
    skipped, pairs wholly inside need no mask); in dual_chunk order with packed rows no visible pair is skipped and
    no pair computed without a mask has an invisible one."""
    block, length = 8, 64
    options = Options(window=window)
    contiguous = np.arange(length, dtype=np.int32)
    one_doc = Tokens(jnp.ones((1, length), jnp.int32), jnp.asarray(contiguous))
    kinds = np.asarray(pair_kinds(one_doc, one_doc, block, block, options))[0]
    np.testing.assert_array_equal(kinds, dense_kinds(contiguous, contiguous, window, block))
    index = layout_index(length, 4, "dual_chunk")
    seg = packed_segments(2, length, seed=window)[:, index]
    balanced = Tokens(jnp.asarray(seg), jnp.asarray(index))
    kinds = np.asarray(pair_kinds(balanced, balanced, block, block, options))
    for row in range(2):
        same = (seg[row][:, None] == seg[row][None, :]) & (seg[row][:, None] > 0)
        visible = same & (index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - window)
        pairs = visible.reshape(length // block, block, length // block, block).transpose(0, 2, 1, 3)
        assert not (pairs.any((2, 3)) & (kinds[row] == SKIP)).any()
        assert not (~pairs.all((2, 3)) & (kinds[row] == FULL)).any()


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_a_bad_window_is_refused(window):
    with pytest.raises(ValueError, match=f"attention window {window!r}"):
        Options(window=window)
    with pytest.raises(ValueError, match="attention window 4"):
        Options(window=4, causal=False)


def test_cudnn_leaves_windows_to_its_general_kernel():
    """cuDNN's packed masks cannot place a global window on a ring step or a balanced chunk, so a windowed call (even
    the causal diagonal it would otherwise serve) runs the general kernel, and the primitives are never called."""
    q, k, v, dout, dlse, _ = data()
    seg = jnp.asarray(packed_segments(BATCH, LENGTH, seed=3))
    tokens = Tokens(seg, np.arange(LENGTH, dtype=np.int32))
    options = Options(scale=DQK**-0.5, block_q=BLOCK, block_kv=BLOCK, window=5)
    never = cudnn.Primitives(None, None)  # calling either raises
    out, lse = cudnn.forward(q, k, v, tokens, tokens, options=options, primitives=never, general=blockwise.forward)
    want_out, want_lse = blockwise.forward(q, k, v, tokens, tokens, options=options)
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    args = (q, k, v, tokens, tokens, out, lse, dout, dlse)
    got = cudnn.backward(*args, options=options, primitives=never, general=blockwise.backward)
    for g, want in zip(got, blockwise.backward(*args, options=options), strict=True):
        np.testing.assert_array_equal(g, want)
