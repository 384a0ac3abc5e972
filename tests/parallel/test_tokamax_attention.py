"""tokamax's flash attention over ranges of keys (parallel/kernels/tokamax_attention.py) through a dense stand-in with
the library's own signature: the ranges equal the reference mask, every kind of call the strategies make and the lse /
dlse contract equal the blockwise kernel (causal or not), the strategies run on it alone, and which calls and devices it
serves."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels, tokamax_calls
from parallel.kernels import Options, Tokens, blockwise, packed, tokamax_attention
from parallel.reorder import layout_index
from tests.parallel.attention_reference import packed_segments
from tests.parallel.cudnn_standin import serve_with_standin
from tests.parallel.test_cudnn import BLOCKS, run
from tests.parallel.test_kernels import HEADS, LENGTH, assert_same, inputs
from tests.parallel.test_strategies import check_strategy
from tests.parallel.tokamax_standin import STANDIN

KERNEL = tuple(functools.partial(f, library=STANDIN) for f in (tokamax_attention.forward, tokamax_attention.backward))


def sides(kind: str, packed_rows: bool, seed: int = 0) -> tuple[Tokens, Tokens]:
    """Two sides of LENGTH tokens of one row of 4 * LENGTH: the diagonal (one token set), a ring step's piece (every
    key before every query), two dual_chunk pieces (keys before and after), striped pieces (interleaved)."""
    full = packed_segments(2, 4 * LENGTH, seed=seed) if packed_rows else np.ones((2, 4 * LENGTH), np.int32)
    layout, (q_rank, kv_rank) = {
        "diagonal": ("contiguous", (1, 1)),
        "preceding": ("contiguous", (1, 0)),
        "halves": ("dual_chunk", (2, 1)),
        "striped": ("striped", (1, 2)),
    }[kind]
    index = layout_index(4 * LENGTH, 4, layout, stripe=4).reshape(4, LENGTH)
    q_index, kv_index = index[q_rank], index[kv_rank]
    return Tokens(jnp.asarray(full[:, q_index]), q_index), Tokens(jnp.asarray(full[:, kv_index]), kv_index)


@pytest.mark.parametrize("kind", ["diagonal", "preceding", "halves", "striped"])
@pytest.mark.parametrize("causal, window", [(True, None), (True, 20), (False, None)])
def test_key_ranges_are_the_reference_mask(kind, causal, window):
    """Packed rows with padding inside and a row all padding: the range [k_start, k_end) of each query is exactly the
    keys the blockwise kernel's mask shows it (its document's, at or before it when causal, inside the window)."""
    q_side, kv_side = sides(kind, packed_rows=True, seed=4)
    k_start, k_end = tokamax_attention.key_ranges(q_side, kv_side, Options(causal=causal, window=window))
    keys = np.arange(LENGTH)
    ranges = (keys >= np.asarray(k_start)[..., None]) & (keys < np.asarray(k_end)[..., None])
    for row in range(2):
        row_sides = (Tokens(side.segment_ids[row], side.index) for side in (q_side, kv_side))
        assert np.array_equal(ranges[row], blockwise.pair_mask(*row_sides, causal=causal, window=window))
    assert ranges.any() and not ranges.all()


@pytest.mark.parametrize(
    "heads, packed_rows, kind",
    [
        ("gqa", True, "diagonal"),
        ("mla", False, "diagonal"),
        ("mha", True, "preceding"),
        ("gqa", True, "halves"),
        ("mla", True, "striped"),
        ("gqa", True, "full"),
    ],
)
def test_standin_kernel_equals_blockwise(heads, packed_rows, kind):
    """Out, lse and the gradients through a loss that reads the lse (a nonzero dlse: its two value columns), padding
    and a fully padded row included (zeros, lse -inf, zero grads)."""
    q, k, v = inputs(*HEADS[heads])
    args = (q, k, v, *sides("halves" if kind == "full" else kind, packed_rows), kind != "full")
    assert_same(run(*KERNEL, *args), run(blockwise.forward, blockwise.backward, *args))


def poisoned(kernel):
    return lambda *args, **kwargs: tuple(x * jnp.nan for x in kernel(*args, **kwargs))


def test_keys_out_of_order_run_the_general_kernel():
    """Static keys out of order are refused at trace time (packed.Unservable: the general kernel
    runs them); traced keys are checked at run time: in order the kernel serves the call (its general kernel returns
    NaN), out of order the general kernel does. A non-causal call is served where the documents' ids increase along
    the row."""
    q, k, v = inputs(*HEADS["gqa"])
    q_side, kv_side = sides("halves", packed_rows=True)
    shuffled = kv_side._replace(index=kv_side.index[::-1].copy())
    with pytest.raises(packed.Unservable, match="increasing global order"):
        KERNEL[0](q, k, v, q_side, shuffled, options=Options(**BLOCKS))

    def traced(kv_index):
        forward = functools.partial(KERNEL[0], general=poisoned(blockwise.forward))
        return forward(q, k, v, q_side, kv_side._replace(index=kv_index), options=Options(**BLOCKS))

    want = blockwise.forward(q, k, v, q_side, kv_side, options=Options(**BLOCKS))
    out, lse = jax.jit(traced)(jnp.asarray(kv_side.index))
    np.testing.assert_allclose(out, want[0], atol=1e-5)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want[1]))
    assert np.isnan(np.asarray(jax.jit(traced)(jnp.asarray(shuffled.index))[0])).all()
    unordered = kv_side._replace(segment_ids=kv_side.segment_ids[:, ::-1])  # documents' ids decrease
    forward = functools.partial(KERNEL[0], general=poisoned(blockwise.forward))
    for kv, served in ((kv_side, True), (unordered, False)):
        out, _ = forward(q, k, v, q_side, kv, options=Options(causal=False, **BLOCKS))
        assert np.isnan(np.asarray(out)).all() != served


@pytest.mark.parametrize(
    "strategy, shards, layout",
    [
        ("ring", 4, "dual_chunk"),
        pytest.param("ring", 4, "striped", marks=pytest.mark.slow),
        pytest.param("all_gather", 4, "dual_chunk", marks=pytest.mark.slow),
        pytest.param("ulysses", 2, "striped", marks=pytest.mark.slow),
        pytest.param("usp", 4, "dual_chunk", marks=pytest.mark.slow),
    ],
)
def test_strategy_with_the_tokamax_kernel(strategy, shards, layout, monkeypatch):
    """tokamax's kernel (the stand-in library) serves every attention call of these strategies, packed and unpacked:
    the blockwise kernel behind it returns NaN, yet outputs and gradients equal the reference."""
    serve_with_standin(monkeypatch, "tokamax", tokamax_attention, max_segments=None, library=STANDIN)
    check_strategy(strategy, shards, layout, case_list=[("gqa", True)], kernel="tokamax")


def test_which_devices_it_serves(monkeypatch):
    """Hopper and newer GPUs where tokamax is installed; a one-line refusal elsewhere, naming what to choose."""
    for backend, capability in (("cpu", None), ("gpu", "8.0")):
        with pytest.raises(ValueError, match="'tokamax' runs on GPUs of compute capability 9"):
            kernels.select("tokamax", backend=backend, capability=capability)
    monkeypatch.setattr(tokamax_calls, "installed", lambda: False)
    with pytest.raises(ValueError, match="needs tokamax"):
        kernels.select("tokamax", backend="gpu", capability="9.0")
    monkeypatch.undo()
    if tokamax_attention.missing() is None:
        kernel = kernels.select("tokamax", backend="gpu", capability="9.0")
        assert kernel.name == "tokamax" and kernels.general_kernel("tokamax", "gpu") == "pallas"
