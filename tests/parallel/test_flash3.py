"""FlashAttention-3 on packed rows (parallel/kernels/flash3.py) through a dense stand-in with the library's own
signature: every kind of call the strategies make, and the lse / dlse contract, against the blockwise kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import kernels
from parallel.kernels import Options, Tokens, blockwise, flash3
from parallel.kernels import packed as packing
from parallel.reorder import layout_index
from tests.parallel.attention_reference import packed_segments
from tests.parallel.cudnn_standin import serve_with_standin
from tests.parallel.flash3_standin import STANDIN
from tests.parallel.test_cudnn import BLOCKS, ring_piece_case, run
from tests.parallel.test_kernels import HEADS, LENGTH, assert_same, inputs
from tests.parallel.test_strategies import check_strategy

KERNEL = tuple(functools.partial(f, library=STANDIN, max_segments=24) for f in (flash3.forward, flash3.backward))


def poisoned_forward(q, k, v, cu_q, cu_k, **params):
    """The library's forward signature and shapes, all NaN: a call that takes it shows in every output."""
    return jnp.full(q.shape, jnp.nan, q.dtype), jnp.full((q.shape[1], q.shape[0]), jnp.nan, jnp.float32)


def poisoned_backward(dout, q, k, v, *rest, **params):
    return tuple(jnp.full(x.shape, jnp.nan, x.dtype) for x in (q, k, v))


POISONED = flash3.Library(poisoned_forward, poisoned_backward)


def sides_of(kind: str, packed: bool):
    if kind == "preceding":
        return ring_piece_case(packed)
    seg = jnp.asarray(packed_segments(2, LENGTH) if packed else np.ones((2, LENGTH), np.int32))
    return (Tokens(seg, np.arange(LENGTH)),) * 2


@pytest.mark.parametrize(
    "heads, packed, kind",
    [
        pytest.param("mha", True, "diagonal", marks=pytest.mark.slow),
        pytest.param("gqa", True, "diagonal", marks=pytest.mark.slow),  # the traced test's first case
        ("mla", False, "diagonal"),
        ("gqa", True, "preceding"),
        pytest.param("mla", True, "preceding", marks=pytest.mark.slow),
        pytest.param("gqa", True, "full", marks=pytest.mark.slow),
    ],
)
def test_standin_kernel_equals_blockwise(heads, packed, kind):
    """Diagonal: causal, one token set; preceding: every key before every query (a ring step's piece); full:
    non-causal. Packed rows have padding and a fully padded row (zeros, lse -inf, zero grads); the loss reaches lse
    (a nonzero dlse)."""
    q, k, v = inputs(*HEADS[heads])
    args = (q, k, v, *sides_of(kind, packed), kind != "full")
    assert_same(run(*KERNEL, *args), run(blockwise.forward, blockwise.backward, *args))


@pytest.mark.parametrize(
    "strategy, shards, layout",
    [
        ("ring", 4, "dual_chunk"),
        pytest.param("all_gather", 4, "dual_chunk", marks=pytest.mark.slow),
        pytest.param("ulysses", 2, "striped", marks=pytest.mark.slow),
        pytest.param("usp", 4, "dual_chunk", marks=pytest.mark.slow),
    ],
)
def test_strategy_with_the_flash3_kernel(strategy, shards, layout, monkeypatch):
    """FlashAttention-3 (the stand-in library) serves every attention call of these strategies, packed and unpacked:
    the blockwise kernel behind it returns NaN, yet outputs and gradients equal the reference."""
    serve_with_standin(monkeypatch, "flash3", flash3, library=STANDIN)
    check_strategy(strategy, shards, layout, case_list=[("gqa", True)], kernel="flash3")


@pytest.mark.slow  # packed.switch's, which test_cudnn checks on the newest stack
def test_traced_indices_choose_the_kind_at_run_time():
    """Under jit the diagonal and preceding calls run the stand-in; queries before keys and a dual_chunk step's
    whole pieces run the general kernel; all equal blockwise."""
    q, k, v = inputs(*HEADS["gqa"])
    seg = jnp.asarray(packed_segments(2, LENGTH))
    preceding = ring_piece_case(True)
    cases = [(Tokens(seg, np.arange(LENGTH)),) * 2, preceding, preceding[::-1]]
    index = layout_index(4 * LENGTH, 4, "dual_chunk").reshape(4, LENGTH)
    full = packed_segments(2, 4 * LENGTH, seed=4)
    cases.append((Tokens(jnp.asarray(full[:, index[1]]), index[1]), Tokens(jnp.asarray(full[:, index[0]]), index[0])))
    for q_side, kv_side in cases:
        sides = lambda qi, ki, q_side=q_side, kv_side=kv_side: (q_side._replace(index=qi), kv_side._replace(index=ki))
        got = jax.jit(lambda qi, ki, sides=sides: run(*KERNEL, q, k, v, *sides(qi, ki), True))
        want = run(blockwise.forward, blockwise.backward, q, k, v, q_side, kv_side, True)
        assert_same(got(q_side.index, kv_side.index), want)


def test_sequences_pair_each_slots_run_and_the_gaps_between():
    """A row of slots becomes the gap before each run, the run, and the last gap; an empty slot is a run of none."""
    seg = jnp.asarray([[0, 1, 1, 3, 3, 3, 0, 0], [2, 2, 2, 2, 5, 0, 0, 0]], jnp.int32)
    meta = packing.metadata(seg, seg, 4)
    cu = flash3.sequences(meta.q_seqlen, meta.q_offsets, 8)
    # row 0: ids 1..4 (2 and 4 empty); row 1 (from token 8): ids 2..5 (3 and 4 empty); then the end
    assert cu.tolist() == [0, 1, 3, 3, 3, 3, 6, 6, 6, 8, 8, 12, 12, 12, 12, 12, 12, 13, 16]
    assert not bool(flash3.out_of_order(meta.q_seqlen, meta.q_offsets))
    backwards = jnp.asarray([[2, 2, 1, 1, 0, 0, 0, 0]], jnp.int32)
    meta = packing.metadata(backwards, backwards, 4)
    assert bool(flash3.out_of_order(meta.q_seqlen, meta.q_offsets))


def test_rows_it_cannot_serve_run_the_general_kernel():
    """Documents numbered against the row's order, or more than the slots, never reach the library (poisoned here)."""
    q, k, v = inputs(*HEADS["gqa"])
    backwards = np.repeat(np.array([[3, 2, 1], [1, 2, 3]], np.int32), LENGTH // 3, axis=1)
    tokens = Tokens(jnp.asarray(backwards), np.arange(LENGTH))
    want = run(blockwise.forward, blockwise.backward, q, k, v, tokens, tokens, True)
    poisoned = [functools.partial(f, library=POISONED, max_segments=8) for f in (flash3.forward, flash3.backward)]
    assert_same(run(*poisoned, q, k, v, tokens, tokens, True), want)
    many = jnp.asarray(np.repeat(np.arange(1, 13, dtype=np.int32), 4)[None].repeat(2, 0))
    tokens = Tokens(many, np.arange(LENGTH))
    assert_same(
        run(*poisoned, q, k, v, tokens, tokens, True),
        run(blockwise.forward, blockwise.backward, q, k, v, tokens, tokens, True),
    )
    served = [functools.partial(f, library=POISONED, max_segments=12) for f in (flash3.forward, flash3.backward)]
    assert np.isnan(np.asarray(run(*served, q, k, v, tokens, tokens, True)[0])).all()


@pytest.mark.parametrize("window", [5, pytest.param(16, marks=pytest.mark.slow)])
def test_a_window_on_a_diagonal_of_consecutive_indices_is_served(window):
    """The kernel's own window on a whole row (consecutive indices) equals blockwise's; a dual_chunk piece's
    diagonal is not consecutive, and raises Unservable (the selected kernel then runs its general kernel)."""
    q, k, v = inputs(*HEADS["gqa"])
    seg = jnp.asarray(packed_segments(2, LENGTH))
    tokens = Tokens(seg, np.arange(LENGTH))
    options = Options(causal=True, window=window, **BLOCKS)

    def both(forward, backward):
        out, lse = forward(q, k, v, tokens, tokens, options=options)
        dlse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return (out, lse, *backward(q, k, v, tokens, tokens, out, lse, out, dlse, options=options))

    assert_same(both(*KERNEL), both(blockwise.forward, blockwise.backward))
    piece = Tokens(seg, layout_index(2 * LENGTH, 2, "dual_chunk")[:LENGTH])
    with pytest.raises(packing.Unservable, match="window"):
        KERNEL[0](q, k, v, piece, piece, options=options)


def test_which_backends_it_serves():
    """flash3 compiles for Hopper (sm90a) alone; elsewhere, or without its wheel, a ValueError says why."""
    with pytest.raises(ValueError, match=r"flash3.*Hopper"):
        kernels.select("flash3", backend="cpu")
    with pytest.raises(ValueError, match=r"flash3.*Hopper"):
        kernels.select("flash3", backend="gpu", capability="10.0")
    if flash3.missing():
        with pytest.raises(ValueError, match="flash3-cuda13"):
            kernels.select("flash3", backend="gpu", capability="9.0")
    else:
        assert kernels.select("flash3", backend="gpu", capability="9.0").name == "flash3"
