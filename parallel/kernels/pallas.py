"""Flash attention as Pallas kernels (Triton on GPU, interpret mode on CPU; on Hopper, Mosaic GPU's kernels of
parallel/kernels/mosaic.py for the calls they serve, the path JAX keeps as it retires Pallas' Triton backend) with
the blockwise kernel's semantics: separate query and key segment ids, causality and sliding windows by global token
index, block pairs that share no segment or lie above the diagonal or outside the window skipped (by the same block
summaries, taken inside the kernel), GQA without repeating key / value heads, query-key and value head dims that
differ, lse out and its cotangent in.

Three kernels: the forward (grid batch x heads x query blocks, a loop over key blocks), dk / dv (grid batch x
key-value heads x key blocks, one loop over the query blocks x the group's query heads) and dq (as the forward).
Head dims are zero-padded to a power of two and lengths to whole power-of-two blocks (Triton's block rule; zero
features change no dot product, padded tokens are segment 0).

Every pallas_call names Triton (its compiler params): JAX 0.10.2 lowers one that names no backend to Mosaic GPU,
which these kernels do not fit. A kernel holds one block (queries: forward, dq; keys: dk / dv) and streams the other
through its loop; the Options' block_q / block_kv are upper bounds, lowered per kernel by `_tiles` from head dims and
itemsize so that each fits an H100's shared memory (227 KiB a block) and registers (tests/gpu_compile). The streamed
operands are passed as blocks of the whole padded length, which need not be a power of two (3 blocks, say): Triton
lowers a block to a base pointer and only the pl.ds windows loaded must be powers of two; nothing of the whole
length is staged in shared memory (Mosaic GPU would copy it there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from parallel import compat
from parallel.kernels import mosaic
from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.blockwise import pad, pad_keys, pad_queries, pair_mask
from parallel.kernels.softmax import backward_delta, finish_lse, safe_shift
from parallel.segments import INT32_MAX, may_see

# Triton compiler params of every kernel: 8 warps (two warpgroups; with 4, H100 compiles of these tiles spill
# registers), 2 stages (as JAX's Pallas attention; the streamed loads sit under the block-skip cond, which Triton's
# pipeliner leaves single-buffered: 1 to 4 stages compile to the same shared memory).
NUM_WARPS, NUM_STAGES = 8, 2


def _tiles(kernel: str, dqk: int, dv: int, itemsize: int) -> tuple[int, int]:
    """(largest held block, largest streamed block) of `kernel` ("forward", "dkdv", "dq"; held: the queries of the
    forward and dq, the keys of dk / dv) for padded head dims and an itemsize, each a power of two in [16, 128]:
    with row = (dqk + dv) * itemsize bytes a token, held blocks take at most 96 KiB of rows (forward) or 64 KiB
    (backward), streamed blocks 32 KiB (forward), 16 KiB (dq, at most 64 rows) or 32 rows (dk / dv). Measured on
    H100 compiles of head dims 64 to 256 (tests/gpu_compile): at most 128 KiB of the 227 KiB shared memory a block
    may use (Triton's tiles of q / k / v / dout, none of them multi-buffered), and in bfloat16 no register spills
    but dq's at head dim 256 (84 bytes); in float32 dk / dv spills 92 to 460 bytes at head dims 128 and above."""
    row = (dqk + dv) * itemsize
    fit = lambda budget: max(16, min(128, 1 << (max(1, budget // row).bit_length() - 1)))
    held = fit(96 << 10 if kernel == "forward" else 64 << 10)
    return held, {"forward": fit(32 << 10), "dkdv": 32, "dq": min(64, fit(16 << 10))}[kernel]


def _block(length: int, block: int) -> int:
    """A power of two (Triton's rule) of at most `block` (at least 16, the smallest matrix-multiply tile) and no
    larger than `length` needs."""
    return max(16, min(1 << (block.bit_length() - 1), pl.next_power_of_2(length)))


def _config(kernel: str, q, k, v, options: Options):
    """(bq, bk, Triton compiler params) of `kernel` for q, k, v (unpadded): the options' blocks capped by _tiles."""
    dqk, dv = pl.next_power_of_2(q.shape[-1]), pl.next_power_of_2(v.shape[-1])
    held, streamed = _tiles(kernel, dqk, dv, max(x.dtype.itemsize for x in (q, k, v)))
    cap_q, cap_kv = (streamed, held) if kernel == "dkdv" else (held, streamed)
    bq, bk = _block(q.shape[1], min(options.block_q, cap_q)), _block(k.shape[1], min(options.block_kv, cap_kv))
    return bq, bk, compat.triton_compiler_params(NUM_WARPS, NUM_STAGES)


def _load(refs: Tokens, at=...) -> Tokens:
    """The tokens held by `refs` (a Tokens of refs: [t] ids and indices) at `at` (all, or a pl.ds window)."""
    return Tokens(refs.segment_ids[at], refs.index[at])


def _summary(tokens: Tokens) -> mosaic.Summary:
    seg, index = tokens.segment_ids, tokens.index
    return mosaic.Summary(jnp.min(jnp.where(seg > 0, seg, INT32_MAX)), jnp.max(seg), jnp.min(index), jnp.max(index))


def _dot(a, b, *, transpose_b: bool = False):
    """a [m, k] @ b [k, n] (or b [n, k] transposed) in float32."""
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _forward_kernel(q_ref, k_ref, v_ref, q_refs: Tokens, kv_refs: Tokens, out_ref, lse_ref, **static):
    causal, sliding, scale = static["causal"], static["window"], static["scale"]
    bk, nk = static["block_kv"], static["kv_blocks"]
    q, q_side = q_ref[...], _load(q_refs)
    q_summary = _summary(q_side)

    def update(window, kv_side, carry):
        row_max, row_sum, acc = carry
        s = _dot(q, k_ref[window, :], transpose_b=True) * scale
        s = jnp.where(pair_mask(q_side, kv_side, causal=causal, window=sliding), s, -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(-1))
        safe_max = safe_shift(new_max)
        p = jnp.exp(s - safe_max[:, None])
        correction = jnp.exp(row_max - safe_max)
        pv = _dot(p.astype(v_ref.dtype), v_ref[window, :])
        return new_max, row_sum * correction + p.sum(-1), acc * correction[:, None] + pv

    def step(j, carry):
        window = pl.ds(j * bk, bk)
        kv_side = _load(kv_refs, window)
        visible = may_see(q_summary, _summary(kv_side), causal=causal, window=sliding)
        return lax.cond(visible, functools.partial(update, window, kv_side), lambda c: c, carry)

    bq = q.shape[0]
    init = (
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((bq, v_ref.shape[-1]), jnp.float32),
    )
    row_max, row_sum, acc = lax.fori_loop(0, nk, step, init)
    seen = row_sum > 0
    out_ref[...] = (acc / jnp.where(seen, row_sum, 1.0)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = finish_lse(row_max, row_sum)


def _pad_operands(q, k, v, q_multiple: int, kv_multiple: int):
    """(q, k, v) with lengths padded to whole multiples of the (power-of-two) blocks given and head dims to powers of
    two."""
    dqk, dv = pl.next_power_of_2(q.shape[-1]), pl.next_power_of_2(v.shape[-1])
    return pad(pad(q, 1, q_multiple), 3, dqk), pad(pad(k, 1, kv_multiple), 3, dqk), pad(pad(v, 1, kv_multiple), 3, dv)


def forward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, interpret=False, out_dtype=None, hopper=False
):  # fmt: skip
    """parallel.kernels.blockwise.forward's arguments and results, as a Pallas kernel: (out [batch, tq, heads, dv] in
    `out_dtype` (default q's), lse [batch, tq, heads] float32). `hopper`: on Mosaic GPU where it serves the call."""
    if hopper and not interpret and mosaic.serves(q, k, v, jnp.dtype(out_dtype or q.dtype).itemsize):
        return mosaic.forward(q, k, v, q_tokens, kv_tokens, options=options, out_dtype=out_dtype)
    batch, tq, heads, _ = q.shape
    kv_heads, dv = k.shape[2], v.shape[-1]
    group = heads // kv_heads
    bq, bk, params = _config("forward", q, k, v, options)
    q, k, v = _pad_operands(q, k, v, bq, bk)
    tq_pad, tk_pad, dqk_pad, dv_pad = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    q_tokens, kv_tokens = pad_queries(q_tokens, tq_pad), pad_keys(kv_tokens, tk_pad)
    static = dict(
        causal=options.causal, window=options.window, scale=options.scale, block_kv=bk, kv_blocks=tk_pad // bk
    )
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, **static),
        grid=(batch, heads, tq_pad // bq),
        in_specs=[
            pl.BlockSpec((None, bq, None, dqk_pad), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, tk_pad, None, dqk_pad), lambda b, h, i: (b, 0, h // group, 0)),
            pl.BlockSpec((None, tk_pad, None, dv_pad), lambda b, h, i: (b, 0, h // group, 0)),
            Tokens(pl.BlockSpec((None, bq), lambda b, h, i: (b, i)), pl.BlockSpec((bq,), lambda b, h, i: (i,))),
            Tokens(pl.BlockSpec((None, tk_pad), lambda b, h, i: (b, 0)), pl.BlockSpec((tk_pad,), lambda b, h, i: (0,))),
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, dv_pad), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, tq_pad, heads, dv_pad), out_dtype or q.dtype),
            jax.ShapeDtypeStruct((batch, heads, tq_pad), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="attention_forward",
    )(q, k, v, q_tokens, kv_tokens)
    return out[:, :tq, :, :dv], jnp.swapaxes(lse, 1, 2)[:, :tq]


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_refs: Tokens, kv_refs: Tokens, dk_ref, dv_ref, **static
):
    causal, sliding, scale = static["causal"], static["window"], static["scale"]
    bq, nq, group = static["block_q"], static["q_blocks"], static["group"]
    k, v, kv_side = k_ref[...], v_ref[...], _load(kv_refs)
    kv_summary = _summary(kv_side)

    def update(window, q_side, head, carry):
        dk, dv = carry
        q, do = q_ref[window, head, :], do_ref[window, head, :]
        lse, delta = lse_ref[head, window], delta_ref[head, window]
        s = _dot(q, k, transpose_b=True) * scale
        lse = safe_shift(lse)
        p = jnp.where(pair_mask(q_side, kv_side, causal=causal, window=sliding), jnp.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, v, transpose_b=True)
        ds = (p * (dp - delta[:, None])).astype(q.dtype)
        dv = dv + _dot(p.astype(do.dtype).T, do)
        dk = dk + _dot(ds.T, q) * scale
        return dk, dv

    def step(n, carry):  # query block n / group, query head n % group of those that share this key-value head
        window = pl.ds(lax.div(n, group) * bq, bq)
        q_side = _load(q_refs, window)
        visible = may_see(_summary(q_side), kv_summary, causal=causal, window=sliding)
        return lax.cond(visible, functools.partial(update, window, q_side, lax.rem(n, group)), lambda c: c, carry)

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, nq * group, step, init)
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_refs: Tokens, kv_refs: Tokens, dq_ref, **static):
    causal, sliding, scale = static["causal"], static["window"], static["scale"]
    bk, nk = static["block_kv"], static["kv_blocks"]
    q, do, q_side = q_ref[...], do_ref[...], _load(q_refs)
    lse, delta = lse_ref[...], delta_ref[...]
    lse = safe_shift(lse)
    q_summary = _summary(q_side)

    def update(window, kv_side, dq):
        k, v = k_ref[window, :], v_ref[window, :]
        s = _dot(q, k, transpose_b=True) * scale
        p = jnp.where(pair_mask(q_side, kv_side, causal=causal, window=sliding), jnp.exp(s - lse[:, None]), 0.0)
        ds = (p * (_dot(do, v, transpose_b=True) - delta[:, None])).astype(k.dtype)
        return dq + _dot(ds, k) * scale

    def step(j, dq):
        window = pl.ds(j * bk, bk)
        kv_side = _load(kv_refs, window)
        visible = may_see(q_summary, _summary(kv_side), causal=causal, window=sliding)
        return lax.cond(visible, functools.partial(update, window, kv_side), lambda c: c, dq)

    dq = lax.fori_loop(0, nk, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def backward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, out, lse, dout, dlse, *, options: Options, interpret=False,
    grad_dtype=None, accumulate=None, hopper=False, delta=None,
):  # fmt: skip
    """parallel.kernels.blockwise.backward's arguments and results, as Pallas kernels: (dq, dk, dv) of `forward`
    given its final out / lse and their cotangents (dlse may be None), in `grad_dtype` (default: the dtypes of q, k,
    v); or, given `accumulate` = (dq, dk, dv) running sums, those sums with them added, in their dtypes. `hopper`:
    on Mosaic GPU where it serves the call. `delta`: the rows' delta given instead of out / dlse (as blockwise's)."""
    if accumulate is not None:
        args = (q, k, v, q_tokens, kv_tokens, out, lse, dout, dlse)
        kwargs = dict(options=options, interpret=interpret, grad_dtype=jnp.float32, hopper=hopper, delta=delta)
        grads = backward(*args, **kwargs)
        return tuple((total + g).astype(total.dtype) for total, g in zip(accumulate, grads, strict=True))
    if hopper and not interpret and mosaic.serves(q, k, v, jnp.dtype(grad_dtype or q.dtype).itemsize):
        args = (q, k, v, q_tokens, kv_tokens, out, lse, dout, dlse)
        return mosaic.backward(*args, options=options, grad_dtype=grad_dtype, delta=delta)
    batch, tq, heads, dqk = q.shape
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    # d score = p (dp - delta), delta = dout . out - dlse (see parallel.kernels.blockwise.backward)
    delta = backward_delta(out, dout, dlse) if delta is None else delta
    dtypes = (q.dtype, k.dtype, v.dtype)
    bq, bk, dkdv_params = _config("dkdv", q, k, v, options)
    bq_dq, bk_dq, dq_params = _config("dq", q, k, v, options)
    q, k, v = _pad_operands(q, k, v, max(bq, bq_dq), max(bk, bk_dq))
    tq_pad, tk_pad, dqk_pad, dv_pad = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    q_tokens, kv_tokens = pad_queries(q_tokens, tq_pad), pad_keys(kv_tokens, tk_pad)
    causal, window, scale = options.causal, options.window, options.scale
    dout = pad(pad(dout, 1, tq_pad), 3, dv_pad)
    lse = jnp.swapaxes(pad(lse, 1, tq_pad, -jnp.inf), 1, 2)  # [batch, heads, tq]
    delta = jnp.swapaxes(pad(delta, 1, tq_pad), 1, 2)
    operands = (q, k, v, dout, lse, delta, q_tokens, kv_tokens)
    dk, dv_ = pl.pallas_call(
        functools.partial(
            _dkdv_kernel, causal=causal, window=window, scale=scale, block_q=bq, q_blocks=tq_pad // bq, group=group
        ),
        grid=(batch, kv_heads, tk_pad // bk),
        in_specs=[
            pl.BlockSpec((None, tq_pad, group, dqk_pad), lambda b, g, j: (b, 0, g, 0)),
            pl.BlockSpec((None, bk, None, dqk_pad), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, bk, None, dv_pad), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, tq_pad, group, dv_pad), lambda b, g, j: (b, 0, g, 0)),
            pl.BlockSpec((None, group, tq_pad), lambda b, g, j: (b, g, 0)),
            pl.BlockSpec((None, group, tq_pad), lambda b, g, j: (b, g, 0)),
            Tokens(pl.BlockSpec((None, tq_pad), lambda b, g, j: (b, 0)), pl.BlockSpec((tq_pad,), lambda b, g, j: (0,))),
            Tokens(pl.BlockSpec((None, bk), lambda b, g, j: (b, j)), pl.BlockSpec((bk,), lambda b, g, j: (j,))),
        ],
        out_specs=[
            pl.BlockSpec((None, bk, None, dqk_pad), lambda b, g, j: (b, j, g, 0)),
            pl.BlockSpec((None, bk, None, dv_pad), lambda b, g, j: (b, j, g, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, grad_dtype or dtypes[1]),
            jax.ShapeDtypeStruct(v.shape, grad_dtype or dtypes[2]),
        ],
        compiler_params=dkdv_params,
        interpret=interpret,
        name="attention_dkdv",
    )(*operands)
    dq = pl.pallas_call(
        functools.partial(
            _dq_kernel, causal=causal, window=window, scale=scale, block_kv=bk_dq, kv_blocks=tk_pad // bk_dq
        ),
        grid=(batch, heads, tq_pad // bq_dq),
        in_specs=[
            pl.BlockSpec((None, bq_dq, None, dqk_pad), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, tk_pad, None, dqk_pad), lambda b, h, i: (b, 0, h // group, 0)),
            pl.BlockSpec((None, tk_pad, None, dv_pad), lambda b, h, i: (b, 0, h // group, 0)),
            pl.BlockSpec((None, bq_dq, None, dv_pad), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq_dq), lambda b, h, i: (b, h, i)),
            pl.BlockSpec((None, None, bq_dq), lambda b, h, i: (b, h, i)),
            Tokens(pl.BlockSpec((None, bq_dq), lambda b, h, i: (b, i)), pl.BlockSpec((bq_dq,), lambda b, h, i: (i,))),
            Tokens(pl.BlockSpec((None, tk_pad), lambda b, h, i: (b, 0)), pl.BlockSpec((tk_pad,), lambda b, h, i: (0,))),
        ],
        out_specs=pl.BlockSpec((None, bq_dq, None, dqk_pad), lambda b, h, i: (b, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, grad_dtype or dtypes[0]),
        compiler_params=dq_params,
        interpret=interpret,
        name="attention_dq",
    )(*operands)
    return dq[:, :tq, :, :dqk], dk[:, :tk, :, :dqk], dv_[:, :tk, :, :dv]
