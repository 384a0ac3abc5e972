"""The cuDNN packed-attention kernel on CPU: its metadata rebuilt into a mask equals the reference mask, stats and
lse map into each other, the whole forward / backward with a dense stand-in for the primitives equals the
blockwise kernel, the real primitives trace, and which calls and backends it serves."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel import compat, kernels
from parallel.kernels import Options, Tokens, blockwise, cudnn, packed, pallas
from parallel.reorder import layout_index
from tests.parallel.attention_reference import packed_segments
from tests.parallel.cudnn_standin import STANDIN
from tests.parallel.test_kernels import HEADS, LENGTH, assert_same, inputs

pytestmark = pytest.mark.both_stacks  # what differs between JAX versions: CI checks it on both

BLOCKS = dict(scale=0.25, block_q=16, block_kv=16)


def poisoned_forward(q, k, v, bias, q_seqlen, *rest, **params):
    """The forward primitive's signature and shapes, all NaN: a call that takes it shows in every output."""
    rows = q_seqlen.shape[0] * q_seqlen.shape[1]
    return [jnp.full(q.shape, jnp.nan, q.dtype), jnp.full((rows, q.shape[2], q.shape[1]), jnp.nan, jnp.float32)]


def poisoned_backward(q, k, v, *rest, **params):
    """The backward primitive's signature and shapes, all NaN."""
    return [jnp.full(x.shape, jnp.nan, x.dtype) for x in (q, k, v)]


POISONED = cudnn.Primitives(poisoned_forward, poisoned_backward)


def mask_from_metadata(meta: packed.Metadata, causal: bool):
    """Metadata -> [batch, tq, tk] bool: (q, k) visible iff both lie in one non-empty slot's runs (and k's position
    in its run <= q's, if causal)."""
    masks = []
    for b in range(meta.q_seqlen.shape[0]):
        q_len, kv_len = np.asarray(meta.q_seqlen[b]), np.asarray(meta.kv_seqlen[b])
        q_off, kv_off = np.asarray(meta.q_offsets[b]), np.asarray(meta.kv_offsets[b])
        mask = np.zeros((meta.q_valid.shape[1], meta.kv_valid.shape[1]), bool)
        for s in np.flatnonzero(q_len >= 0):
            block = np.ones((q_len[s], kv_len[s]), bool)
            if causal:
                block = np.tril(block)
            mask[q_off[s] : q_off[s] + q_len[s], kv_off[s] : kv_off[s] + kv_len[s]] = block
        masks.append(mask)
    return np.stack(masks)


def reference_mask(q_seg, kv_seg, causal: bool):
    """[batch, tq, tk] bool: same non-zero segment (and kv index <= q index, local order, if causal)."""
    q_seg, kv_seg = np.asarray(q_seg), np.asarray(kv_seg)
    mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] > 0)
    return mask & np.tril(np.ones(mask.shape[1:], bool)) if causal else mask


@pytest.mark.parametrize("causal", [True, False])
def test_metadata_rebuilds_the_mask(causal):
    """Packed rows with padding gaps, a fully padded row, ids starting above 1 (a piece's), and for all-visible
    calls keys from other pieces (ids below the queries', absent from them); empty slots -1 in seqlens and
    offsets alike, so their left-shifted lists stay aligned."""
    seg = packed_segments(3, LENGTH, seed=5)
    seg[1] = np.where(seg[1] > 0, seg[1] + 7, 0)  # ids 8.. as in a later piece of the sequence
    kv_seg = seg.copy() if causal else np.where(seg > 0, seg + 1, 0)  # for keys: doc d's ids belong to doc d + 1
    meta = packed.metadata(jnp.asarray(seg), jnp.asarray(kv_seg), max_segments=24)
    assert np.array_equal(mask_from_metadata(meta, causal), reference_mask(seg, kv_seg, causal))
    for lengths, offsets in ((meta.q_seqlen, meta.q_offsets), (meta.kv_seqlen, meta.kv_offsets)):
        assert np.array_equal(np.asarray(lengths) < 0, np.asarray(offsets[:, :-1]) < 0)
        assert np.all(np.asarray(offsets[:, -1]) == -1) and np.all(np.asarray(lengths) != 0)
    assert np.array_equal(meta.q_valid, reference_mask(seg, kv_seg, False).any(-1))
    assert np.array_equal(meta.kv_valid, reference_mask(seg, kv_seg, False).any(-2))


@pytest.mark.newest_stack
def test_too_many_segments_run_the_blockwise_kernel():
    """A row whose query ids span more than max_segments slots: the call runs the blockwise kernel (equal to it),
    with static and with traced indices; within the limit it runs the stand-in."""
    seg = jnp.asarray(np.repeat(np.arange(1, 13, dtype=np.int32), 4)[None].repeat(2, 0))
    assert bool(packed.too_many_segments(seg, 8)) and not bool(packed.too_many_segments(seg, 12))
    q, k, v = inputs(*HEADS["gqa"])
    index = np.arange(LENGTH)
    args = (q, k, v, Tokens(seg, index), Tokens(seg, index), True)
    want = run(blockwise.forward, blockwise.backward, *args)
    kernel = [functools.partial(f, primitives=STANDIN, max_segments=8) for f in (cudnn.forward, cudnn.backward)]
    assert_same(run(*kernel, *args), want)
    assert_same(jax.jit(lambda i: run(*kernel, q, k, v, Tokens(seg, i), Tokens(seg, i), True))(index), want)
    standin = [functools.partial(f, primitives=POISONED, max_segments=8) for f in (cudnn.forward, cudnn.backward)]
    assert_same(run(*standin, *args), want)  # the primitives are never taken
    standin = [functools.partial(f, primitives=POISONED, max_segments=12) for f in (cudnn.forward, cudnn.backward)]
    assert np.isnan(np.asarray(run(*standin, *args)[0])).all()


def test_slots_keep_cudnns_padded_buffers_within_the_budget():
    """cuDNN pads each slot to the call's length (64 slots of a 128K-token row of 32 heads of 128 took 147 GiB on an
    H200): a call takes the slots that fit slot_bytes, at least 2, at most max_segments; a row with more documents
    than its slots runs the general kernel, the primitives untaken."""
    assert cudnn.slots((1, 131072, 32, 128), 128) == 2
    assert cudnn.slots((1, 16384, 32, 128), 128) == 14  # a 128K row's ring step over 8 devices
    assert cudnn.slots((2, LENGTH, 4, 64), 64) == cudnn.MAX_SEGMENTS
    seg = jnp.asarray(np.repeat(np.arange(1, 13, dtype=np.int32), 4)[None].repeat(2, 0))
    q, k, v = inputs(*HEADS["gqa"])
    per_slot = q.shape[0] * LENGTH * q.shape[2] * (packed.width(q.shape[-1], v.shape[-1], 2) + 2) * 4
    index = np.arange(LENGTH)
    args = (q, k, v, Tokens(seg, index), Tokens(seg, index), True)
    standin = [
        functools.partial(f, primitives=POISONED, slot_bytes=8 * per_slot) for f in (cudnn.forward, cudnn.backward)
    ]
    assert_same(run(*standin, *args), run(blockwise.forward, blockwise.backward, *args))
    standin = [
        functools.partial(f, primitives=POISONED, slot_bytes=12 * per_slot) for f in (cudnn.forward, cudnn.backward)
    ]
    assert np.isnan(np.asarray(run(*standin, *args)[0])).all()


def test_stats_and_lse_round_trip():
    """lse -> stats -> lse is the identity on tokens in a segment and -inf elsewhere; stats rows are the non-empty
    slots of all rows in order, columns positions within the segment."""
    seg = jnp.asarray(packed_segments(2, LENGTH, seed=1))
    meta = packed.metadata(seg, seg, max_segments=16)
    lse = jnp.asarray(np.random.default_rng(0).normal(size=(2, LENGTH, 3)), jnp.float32)
    stats = cudnn.stats_from_lse(lse, meta, rows=2 * 16)
    back = cudnn.lse_from_stats(stats, meta)
    assert np.array_equal(np.asarray(back), np.where(np.asarray(meta.q_valid)[..., None], lse, -np.inf))
    first = int(np.asarray(meta.q_offsets)[0, 0])  # row 0's first segment: stats row 0, position 0
    assert np.array_equal(stats[0, :, 0], lse[0, first])


def run(forward, backward, q, k, v, q_tokens, kv_tokens, causal):
    """(out, lse, dq, dk, dv) of a loss through out and lse (a nonzero dlse), through forward / backward."""
    rng = np.random.default_rng(1)
    w_out = jnp.asarray(rng.normal(size=(*q.shape[:3], v.shape[-1])), jnp.float32)
    w_lse = jnp.asarray(rng.normal(size=q.shape[:3]), jnp.float32)
    options = Options(causal=causal, **BLOCKS)
    out, lse = forward(q, k, v, q_tokens, kv_tokens, options=options)
    dlse = jnp.where(jnp.isfinite(lse), w_lse, 0.0)
    grads = backward(q, k, v, q_tokens, kv_tokens, out, lse, w_out, dlse, options=options)
    return out, lse, *grads


STANDIN_KERNEL = (
    functools.partial(cudnn.forward, primitives=STANDIN, max_segments=24),
    functools.partial(cudnn.backward, primitives=STANDIN, max_segments=24),
)


def ring_piece_case(packed: bool) -> tuple[Tokens, Tokens]:
    """Queries at global indices 48..95 against keys at 0..47 of one packed sequence of 96: all keys precede."""
    seg = packed_segments(2, 2 * LENGTH, seed=3) if packed else np.ones((2, 2 * LENGTH), np.int32)
    index = np.arange(2 * LENGTH, dtype=np.int32)
    return Tokens(jnp.asarray(seg[:, LENGTH:]), index[LENGTH:]), Tokens(jnp.asarray(seg[:, :LENGTH]), index[:LENGTH])


@pytest.mark.parametrize(
    "heads, packed, kind",
    [
        ("mha", True, "diagonal"),
        ("gqa", True, "diagonal"),
        ("mla", False, "diagonal"),
        ("gqa", True, "preceding"),
        ("mla", True, "preceding"),
        ("mha", False, "preceding"),
        ("gqa", True, "full"),
        ("mla", True, "full"),
    ],
)
def test_standin_kernel_equals_blockwise(heads, packed, kind):
    """Diagonal: causal, one token set; preceding: causal, every key before every query (a ring step's piece);
    full: non-causal. Packed rows have a fully padded row (no visible key: zeros, lse -inf, zero grads)."""
    q, k, v = inputs(*HEADS[heads])
    if kind == "preceding":
        sides = ring_piece_case(packed)
    else:
        seg = jnp.asarray(packed_segments(2, LENGTH) if packed else np.ones((2, LENGTH), np.int32))
        sides = (Tokens(seg, np.arange(LENGTH)),) * 2
    args = (q, k, v, *sides, kind != "full")
    assert_same(run(*STANDIN_KERNEL, *args), run(blockwise.forward, blockwise.backward, *args))


@pytest.mark.newest_stack
def test_traced_indices_choose_the_kind_at_run_time():
    """Under jit the indices are traced: the diagonal and preceding calls run the stand-in, the others (queries
    before keys; a dual_chunk ring step's whole pieces, partly visible) are general and run the blockwise kernel,
    all equal to blockwise."""
    q, k, v = inputs(*HEADS["gqa"])
    seg = jnp.asarray(packed_segments(2, LENGTH))
    preceding = ring_piece_case(True)
    cases = [(Tokens(seg, np.arange(LENGTH)),) * 2, preceding, preceding[::-1]]  # queries before keys: general
    index = layout_index(4 * LENGTH, 4, "dual_chunk").reshape(4, LENGTH)
    full = packed_segments(2, 4 * LENGTH, seed=4)
    cases.append((Tokens(jnp.asarray(full[:, index[1]]), index[1]), Tokens(jnp.asarray(full[:, index[0]]), index[0])))
    traced = lambda side: side._replace(index=jnp.asarray(side.index))
    kinds = [packed.runtime_kind(traced(q_side), traced(kv_side)) for q_side, kv_side in cases]
    assert [int(kind) for kind in kinds] == [cudnn.DIAGONAL, cudnn.ALL_VISIBLE, packed.GENERAL, packed.GENERAL]
    for q_side, kv_side in cases:
        sides = lambda qi, ki: (q_side._replace(index=qi), kv_side._replace(index=ki))
        got = jax.jit(lambda qi, ki: run(*STANDIN_KERNEL, q, k, v, *sides(qi, ki), True))
        want = run(blockwise.forward, blockwise.backward, q, k, v, q_side, kv_side, True)
        assert_same(got(q_side.index, kv_side.index), want)


def test_backward_adds_into_running_sums():
    """backward(accumulate=sums) is sums + backward, in the sums' dtypes."""
    q, k, v = inputs(*HEADS["mla"])
    seg = jnp.asarray(packed_segments(2, LENGTH))
    tokens = Tokens(seg, np.arange(LENGTH))
    options = Options(causal=True, **BLOCKS)
    out, lse = STANDIN_KERNEL[0](q, k, v, tokens, tokens, options=options)
    sums = [jnp.full(x.shape, 0.5, jnp.float32) for x in (q, k, v)]
    got = STANDIN_KERNEL[1](q, k, v, tokens, tokens, out, lse, out, None, options=options, accumulate=sums)
    fresh = STANDIN_KERNEL[1](q, k, v, tokens, tokens, out, lse, out, None, options=options)
    for total, g in zip(got, fresh, strict=True):
        np.testing.assert_allclose(total, g + 0.5, rtol=1e-6)


def primitive_calls(jaxpr) -> list:
    """The cuDNN primitive equations of `jaxpr` and of every jaxpr nested in it (switch branches), in order."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("dot_product_attention"):
            calls.append(eqn)
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else [value]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    calls += primitive_calls(inner)
    return calls


@pytest.mark.parametrize("heads", ["mha", "gqa", "mla"])
def test_real_primitives_trace(heads):
    """The real forward / backward trace in bfloat16 to the cuDNN wrapper primitives, with the packed metadata
    ([batch, m] seqlens, [batch, m + 1] offsets), K / V with their own heads where JAX's binding allows (else
    repeated to the query heads) and one padded head width."""
    h, hkv, dqk, dv = HEADS[heads]
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs(h, hkv, dqk, dv))
    seg = jnp.asarray(packed_segments(2, LENGTH))
    index = np.arange(LENGTH)
    options = Options(causal=True, **BLOCKS)

    def loss(q, k, v, index):
        """(dq, dk, dv) of forward then backward, lse's cotangent = lse."""
        tokens = Tokens(seg, index)
        out, lse = cudnn.forward(q, k, v, tokens, tokens, options=options, max_segments=8)
        return cudnn.backward(q, k, v, tokens, tokens, out, lse, out, lse, options=options, max_segments=8)

    # static indices: the diagonal's forward and backward only; traced: the run-time switch's served branches,
    # the diagonal and all-visible
    fixed = primitive_calls(jax.make_jaxpr(functools.partial(loss, index=index))(q, k, v).jaxpr)
    assert [e.primitive.name for e in fixed] == [
        "dot_product_attention_fwd_wrapper",
        "dot_product_attention_bwd_wrapper",
    ]
    assert [e.params["mask_type"] for e in fixed] == [cudnn.MASKS[cudnn.DIAGONAL]] * 2
    calls = primitive_calls(jax.make_jaxpr(loss)(q, k, v, index).jaxpr)
    names = ["dot_product_attention_fwd_wrapper"] * 2 + ["dot_product_attention_bwd_wrapper"] * 2
    assert [e.primitive.name for e in calls] == names
    masks = [cudnn.MASKS[cudnn.DIAGONAL], cudnn.MASKS[cudnn.ALL_VISIBLE]]
    assert [e.params["mask_type"] for e in calls] == masks * 2
    width = -(-max(dqk, dv + 2) // 8) * 8  # the backward carries dlse in two extra value features
    q_op, k_op, v_op, _, q_len, _, q_off = calls[2].invars[:7]
    kv_heads = hkv if compat.cudnn_packed_gqa() else h  # K / V repeated where JAX's binding needs it
    assert q_op.aval.shape == (2, LENGTH, h, width)
    assert k_op.aval.shape == v_op.aval.shape == (2, LENGTH, kv_heads, width)
    assert q_len.aval.shape == (2, 8) and q_off.aval.shape == (2, 9)
    assert calls[0].outvars[1].aval.shape == (2 * 8, h, LENGTH)
    shapes = jax.eval_shape(loss, q, k, v, index)
    assert [s.shape for s in shapes] == [q.shape, k.shape, v.shape]


def test_which_calls_and_backends_it_serves():
    index = np.arange(8)
    assert packed.call_kind(index, index, True) == cudnn.DIAGONAL
    assert packed.call_kind(index + 8, index, True) == cudnn.ALL_VISIBLE
    assert packed.call_kind(index, index + 8, False) == cudnn.ALL_VISIBLE
    with pytest.raises(cudnn.Unservable, match=r"causal diagonal .* or keys that all precede the queries"):
        packed.call_kind(index, index + 4, True)
    with pytest.raises(cudnn.Unservable):  # a dual_chunk ring step's whole pieces: the ring calls its halves
        packed.call_kind(*layout_index(32, 4, "dual_chunk").reshape(4, 8)[[2, 1]], True)
    # static diagonal indices with key segment ids unlike the queries' (a key padding mask): run-time general
    q, k, v = inputs(*HEADS["gqa"])
    seg = jnp.asarray(packed_segments(2, LENGTH))
    whole = np.arange(LENGTH)
    args = (q, k, v, Tokens(seg, whole), Tokens(seg.at[:, :4].set(0), whole), True)
    assert_same(run(*STANDIN_KERNEL, *args), run(blockwise.forward, blockwise.backward, *args))
    # a whole dual_chunk sequence (a document in two runs) is no packed row: static unservable, traced general
    shuffled = layout_index(LENGTH, 2, "dual_chunk")
    with pytest.raises(cudnn.Unservable, match="increasing global order"):
        packed.call_kind(shuffled, shuffled, False)
    q, k, v = inputs(*HEADS["gqa"])
    seg = jnp.asarray(packed_segments(2, LENGTH)[:, shuffled])
    traced = Tokens(seg, jnp.asarray(shuffled))
    assert int(packed.runtime_kind(traced, traced, causal=False)) == packed.GENERAL
    got = jax.jit(lambda i: run(*STANDIN_KERNEL, q, k, v, Tokens(seg, i), Tokens(seg, i), False))(shuffled)
    want = run(blockwise.forward, blockwise.backward, q, k, v, Tokens(seg, shuffled), Tokens(seg, shuffled), False)
    assert_same(got, want)
    # traced, one query against keys around it runs the blockwise kernel
    q, k, v = inputs(*HEADS["gqa"], tq=1)
    one, seg = jnp.ones((2, 1), jnp.int32), jnp.ones((2, LENGTH), jnp.int32)
    sides = lambda qi, ki: (Tokens(one, qi), Tokens(seg, ki))
    got = jax.jit(lambda qi, ki: run(*STANDIN_KERNEL, q, k, v, *sides(qi, ki), True))(np.array([20]), np.arange(LENGTH))
    assert_same(
        got, run(blockwise.forward, blockwise.backward, q, k, v, *sides(np.array([20]), np.arange(LENGTH)), True)
    )
    with pytest.raises(ValueError, match=r"attention kernel 'cudnn' runs on GPUs of compute capability 9.0 .*not cpu"):
        kernels.select("cudnn", backend="cpu")
    # a static general call through the selected kernel runs the Pallas kernel on GPU (no cuDNN call is traced)
    impl = kernels.select("cudnn", backend="gpu", capability="9.0", interpret=True)
    q, k, v = (x.astype(jnp.bfloat16) for x in inputs(*HEADS["gqa"]))
    seg = jnp.ones((2, LENGTH), jnp.int32)
    sides = (Tokens(seg, np.arange(LENGTH)), Tokens(seg, np.arange(LENGTH) + 8))
    options = Options(causal=True, **BLOCKS)
    got = impl.forward(q, k, v, *sides, options=options)
    want = pallas.forward(q, k, v, *sides, options=options, interpret=True)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    # inputs the real primitives reject are unservable: float32, or a padded head width past 256 (heads of 256 are
    # served but for a backward given an lse cotangent, whose two columns make them 264 wide)
    diagonal = (sides[0], sides[0])
    with pytest.raises(cudnn.Unservable, match=r"bfloat16 or float16 inputs .*, not float32"):
        cudnn.forward(*inputs(*HEADS["mha"]), *diagonal, options=options)
    wide = [x.astype(jnp.bfloat16) for x in inputs(4, 4, 256, 256)]
    out, lse = jax.eval_shape(lambda q, k, v: cudnn.forward(q, k, v, *diagonal, options=options), *wide)
    backward = lambda dlse: lambda q, k, v: cudnn.backward(q, k, v, *diagonal, out, lse, out, dlse, options=options)
    assert [g.shape for g in jax.eval_shape(backward(None), *wide)] == [x.shape for x in wide]
    with pytest.raises(cudnn.Unservable, match="width 264"):
        jax.eval_shape(backward(lse), *wide)
