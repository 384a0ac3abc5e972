"""Blockwise (flash-style) attention in plain JAX, forward and backward: online softmax over key blocks,
recomputation in the backward pass, and block pairs that share no segment, lie above the causal diagonal or wholly
outside a sliding window skipped entirely. The CPU kernel and the reference for the others, whose forward / backward
take its arguments; `parallel.kernels.attention` makes it differentiable.

Causality and the window compare GLOBAL token indices (each side's `Tokens.index`), so the pieces a device holds may be
non-contiguous (load-balanced layouts) and come from different devices (ring steps).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from parallel.kernels import visible
from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.softmax import backward_delta, finish_lse, safe_shift
from parallel.rounding import ceil_div, round_up
from parallel.segments import INT32_MAX, block_summary, full_blocks, visible_blocks, visible_pairs


def pad(x, axis: int, multiple: int, value=0):
    """Pads `axis` of x up to a multiple of `multiple` with `value`."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_queries(tokens: Tokens, multiple: int) -> Tokens:
    """Query segment ids [batch, tq] padded up to a multiple of `multiple` with 0 and indices [tq] with their
    largest: padded queries (segment 0, seeing nothing) then leave the last block's index range as its real
    queries', so its causal and window ranges skip what they would."""
    index = tokens.index
    return Tokens(pad(tokens.segment_ids, 1, multiple), pad(index, 0, multiple, jnp.max(index)))


def pad_keys(tokens: Tokens, multiple: int) -> Tokens:
    """Key segment ids [batch, tk] padded with 0 and indices [tk] with INT32_MAX up to a multiple of `multiple`:
    padded keys (segment 0, never visible) then leave the last block's causal range as its real keys', so query
    blocks before them skip it instead of computing it masked."""
    return Tokens(pad(tokens.segment_ids, 1, multiple), pad(tokens.index, 0, multiple, INT32_MAX))


def padded_blocks(length: int, block: int) -> tuple[int, int]:
    """(block size, number of blocks) for a sequence of `length` with at most `block` tokens per block: as few
    blocks as `block` allows, of equal size rounded up to a multiple of 8, so padding stays under 8 blocks x 8
    tokens (a 768-token piece with block 512 is two blocks of 384, not 1024 tokens of which 256 are padding)."""
    count = ceil_div(length, block)
    size = min(length, round_up(ceil_div(length, count), 8))
    return size, ceil_div(length, size)


def even_chunk(length: int, at_most: int) -> int:
    """The largest chunk size of at most `at_most` that divides `length` (1 at worst): equal chunks, no padding."""
    return max(d for d in range(1, min(at_most, length) + 1) if length % d == 0)


def block_ranges(visible):
    """visible: [batch, n, m] bool -> (first, one past last) visible column per row, [batch, n] int32 (0, 0 if none)."""
    m = visible.shape[-1]
    any_visible = visible.any(-1)
    first = jnp.argmax(visible, axis=-1)
    last = m - jnp.argmax(visible[..., ::-1], axis=-1)
    return jnp.where(any_visible, first, 0).astype(jnp.int32), jnp.where(any_visible, last, 0).astype(jnp.int32)


def take_block(x, b, i, size):
    """Rows [i*size, (i+1)*size) of batch row b of x: [batch, t, ...] -> [size, ...]."""
    start = (b, i * size) + (0,) * (x.ndim - 2)
    return lax.dynamic_slice(x, start, (1, size, *x.shape[2:]))[0]


def side_block(tokens: Tokens, b, i, size) -> Tokens:
    """Tokens [i*size, (i+1)*size) of batch row b: segment ids and indices, each [size]."""
    return Tokens(take_block(tokens.segment_ids, b, i, size), lax.dynamic_slice_in_dim(tokens.index, i * size, size))


def _query_block(x, b, i, size, kv_heads: int):
    """Query rows [i*size, (i+1)*size) of batch row b of x [batch, t, heads, d] -> [kv_heads, size * group, d]:
    the queries of one key/value head as one matrix, so every block matmul is batched over kv_heads with the batch
    dimension leading (a plain batched GEMM on CPU, about 1.5x faster than token-major operands). Only the block
    is transposed, O(block) per pair, never a whole array."""
    blk = take_block(x, b, i, size)
    return blk.reshape(size, kv_heads, -1, x.shape[-1]).transpose(1, 0, 2, 3).reshape(kv_heads, -1, x.shape[-1])


def _key_block(x, b, j, size):
    """Key rows [j*size, (j+1)*size) of batch row b of x [batch, t, kv_heads, d] -> [kv_heads, size, d]."""
    return take_block(x, b, j, size).transpose(1, 0, 2)


def _token_rows(x, size: int):
    """[kv_heads, size * group, d] (a `_query_block` layout) -> [size, heads, d]."""
    kv_heads, _, d = x.shape
    return x.reshape(kv_heads, size, -1, d).transpose(1, 0, 2, 3).reshape(size, -1, d)


def _add_at(x, blk, at):
    """x with blk (x's rank, a slice's shape) added in place at start index `at`, in x's dtype."""
    old = lax.dynamic_slice(x, at, blk.shape)
    return lax.dynamic_update_slice(x, (old + blk).astype(x.dtype), at)


def pair_kinds(q: Tokens, kv: Tokens, bq: int, bk: int, options: Options):
    """[batch, nq, nk] int32 kind of each block pair of sides q and kv (padded to whole blocks of bq / bk): SKIP (no
    visible pair), MASKED (some), FULL (all visible, so no mask is built)."""
    q_summary = block_summary(q.segment_ids, q.index, bq)
    kv_summary = block_summary(kv.segment_ids, kv.index, bk)
    mask = dict(causal=options.causal, window=options.window)
    visible = visible_blocks(q_summary, kv_summary, **mask)
    return visible.astype(jnp.int32) + full_blocks(q_summary, kv_summary, **mask).astype(jnp.int32)


SKIP, MASKED, FULL = 0, 1, 2


def pair_mask(q: Tokens, kv: Tokens, *, causal: bool, window: int | None = None):
    """The tokens of a query and a key block ([bq] / [bk] ids and global indices) -> [bq, bk] visibility."""
    rows, columns = Tokens(q.segment_ids[:, None], q.index[:, None]), Tokens(kv.segment_ids[None], kv.index[None])
    return visible_pairs(rows, columns, causal=causal, window=window)


def _pair_mask(q: Tokens, kv: Tokens, group: int, options: Options):
    """The tokens of one block pair ([bq] / [bk] ids and indices) -> [1, bq * group, bk] visibility."""
    mask = pair_mask(q, kv, causal=options.causal, window=options.window)
    return jnp.broadcast_to(mask[:, None, :], (mask.shape[0], group, mask.shape[1])).reshape(1, -1, mask.shape[1])


def _scores(q_blk, k_blk, scale):
    """q_blk [kv_heads, bq * group, d], k_blk [kv_heads, bk, d] -> float32 [kv_heads, bq * group, bk]."""
    return jnp.einsum("hqd,hkd->hqk", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def forward(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, out_dtype=None):
    """Forward pass without the custom VJP (strategies call it directly). q [batch, tq, heads, dqk], k [batch, tk,
    kv_heads, dqk], v [batch, tk, kv_heads, dv]; the tokens of each side and the options all given (see
    parallel.kernels.arguments). Returns (out [batch, tq, heads, dv] in `out_dtype` (default q's), lse [batch, tq,
    heads] float32); a query with no visible key gets zeros and lse -inf."""
    batch, tq, heads = q.shape[:3]
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    scale = options.scale
    bq, nq = padded_blocks(tq, options.block_q)
    bk, nk = padded_blocks(tk, options.block_kv)
    q, q_tokens = pad(q, 1, bq), pad_queries(q_tokens, bq)
    k, v, kv_tokens = pad(k, 1, bk), pad(v, 1, bk), pad_keys(kv_tokens, bk)
    kinds = pair_kinds(q_tokens, kv_tokens, bq, bk, options)
    first, last = block_ranges(kinds > SKIP)

    def q_block(flat):
        b, i = flat // nq, flat % nq
        q_blk = _query_block(q, b, i, bq, kv_heads)
        q_side = side_block(q_tokens, b, i, bq)

        def update(j, masked, carry):
            row_max, row_sum, acc = carry
            k_blk, v_blk = _key_block(k, b, j, bk), _key_block(v, b, j, bk)
            s = _scores(q_blk, k_blk, scale)
            if masked:
                mask = _pair_mask(q_side, side_block(kv_tokens, b, j, bk), group, options)
                s = jnp.where(mask, s, -jnp.inf)
            new_max = jnp.maximum(row_max, s.max(-1))
            safe_max = safe_shift(new_max)
            p = jnp.exp(s - safe_max[..., None])
            correction = jnp.exp(row_max - safe_max)
            pv = jnp.einsum("hqk,hkd->hqd", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return new_max, row_sum * correction + p.sum(-1), acc * correction[..., None] + pv

        def step(j, carry):
            branches = (lambda c: c, functools.partial(update, j, True), functools.partial(update, j, False))
            return lax.switch(kinds[b, i, j], branches, carry)

        init = (
            jnp.full((kv_heads, bq * group), -jnp.inf, jnp.float32),
            jnp.zeros((kv_heads, bq * group), jnp.float32),
            jnp.zeros((kv_heads, bq * group, dv), jnp.float32),
        )
        with visible.bounded(nk):
            row_max, row_sum, acc = lax.fori_loop(first[b, i], last[b, i], step, init)
        seen = row_sum > 0
        out = acc / jnp.where(seen, row_sum, 1.0)[..., None]
        lse = finish_lse(row_max, row_sum)
        return _token_rows(out.astype(out_dtype or q.dtype), bq), _token_rows(lse[..., None], bq)[..., 0]

    out, lse = lax.map(q_block, jnp.arange(batch * nq))
    return out.reshape(batch, nq * bq, heads, dv)[:, :tq], lse.reshape(batch, nq * bq, heads)[:, :tq]


def backward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, out, lse, dout, dlse, *, options: Options, grad_dtype=None,
    accumulate=None, delta=None,
):  # fmt: skip
    """Gradients (dq, dk, dv) of `forward` (the same q, k, v, tokens and options) given its final out [batch, tq,
    heads, dv] / lse [batch, tq, heads] and their cotangents (dlse may be None), in `grad_dtype` (default: the dtypes
    of q, k, v); or, given `accumulate` = (dq, dk, dv) running sums (a ring's), those sums with this call's gradients
    added, in their dtypes, updated in place (no per-call gradient arrays). `delta` [batch, tq, heads] float32: the
    rows' delta (below) computed by the caller once for many calls, out and dlse then unused (None).

    One pass over key blocks; for each, the visible query blocks update dk/dv locally and dq in place, and the
    finished dk/dv block is added into dk/dv.
    """
    batch, tq, heads, dqk = q.shape
    tk, kv_heads, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    # d score_ij = p_ij (dp_ij - delta_i) with delta_i = sum_j p_ij dp_ij = dout_i . out_i. When lse is an output
    # too (a ring step's partial lse feeds the merge), d lse_i / d score_ij = p_ij adds p_ij dlse_i to d score_ij:
    # the same form with delta_i - dlse_i, so both gradients flow through one pass.
    delta = backward_delta(out, dout, dlse) if delta is None else delta  # [batch, tq, heads]
    scale = options.scale
    bq, nq = padded_blocks(tq, options.block_q)
    bk, nk = padded_blocks(tk, options.block_kv)
    q, dout, q_tokens = pad(q, 1, bq), pad(dout, 1, bq), pad_queries(q_tokens, bq)
    lse, delta = pad(lse, 1, bq, -jnp.inf), pad(delta, 1, bq)
    k, v, kv_tokens = pad(k, 1, bk), pad(v, 1, bk), pad_keys(kv_tokens, bk)
    kinds_t = jnp.swapaxes(pair_kinds(q_tokens, kv_tokens, bq, bk, options), 1, 2)  # [batch, nk, nq]
    first, last = block_ranges(kinds_t > SKIP)
    lse, delta = lse[..., None], delta[..., None]

    def kv_block(flat, grads):
        dq, dk, dv_ = grads
        b, j = flat // nk, flat % nk
        k_blk, v_blk = _key_block(k, b, j, bk), _key_block(v, b, j, bk)
        kv_side = side_block(kv_tokens, b, j, bk)

        def update(i, masked, dk_blk, dv_blk):
            """(this pair's dq block, dk_blk and dv_blk with its terms added)."""
            q_blk, do_blk = _query_block(q, b, i, bq, kv_heads), _query_block(dout, b, i, bq, kv_heads)
            lse_blk, delta_blk = _query_block(lse, b, i, bq, kv_heads), _query_block(delta, b, i, bq, kv_heads)
            s = _scores(q_blk, k_blk, scale)
            p = jnp.exp(s - safe_shift(lse_blk))
            if masked:
                p = jnp.where(_pair_mask(side_block(q_tokens, b, i, bq), kv_side, group, options), p, 0.0)
            dp = jnp.einsum("hqd,hkd->hqk", do_blk, v_blk, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_blk)).astype(q.dtype)
            dq_blk = jnp.einsum("hqk,hkd->hqd", ds, k_blk, preferred_element_type=jnp.float32) * scale
            dk_blk = dk_blk + jnp.einsum("hqk,hqd->hkd", ds, q_blk, preferred_element_type=jnp.float32) * scale
            dv_blk = dv_blk + jnp.einsum(
                "hqk,hqd->hkd", p.astype(do_blk.dtype), do_blk, preferred_element_type=jnp.float32
            )
            return _token_rows(dq_blk, bq)[None], dk_blk, dv_blk

        def skip(dk_blk, dv_blk):
            return jnp.zeros((1, bq, heads, dqk), jnp.float32), dk_blk, dv_blk

        def step(i, carry):
            # dq stays outside the branches, so the switch never passes (and copies) the whole dq buffer
            dq, dk_blk, dv_blk = carry
            branches = (skip, functools.partial(update, i, True), functools.partial(update, i, False))
            dq_blk, dk_blk, dv_blk = lax.switch(kinds_t[b, j, i], branches, dk_blk, dv_blk)
            return _add_at(dq, dq_blk, (b, i * bq, 0, 0)), dk_blk, dv_blk

        init = (dq, jnp.zeros((kv_heads, bk, dqk), jnp.float32), jnp.zeros((kv_heads, bk, dv), jnp.float32))
        with visible.bounded(nq):
            dq, dk_blk, dv_blk = lax.fori_loop(first[b, j], last[b, j], step, init)
        at = (b, j * bk, 0, 0)  # [kv_heads, bk, d] blocks go back to token-major rows
        return dq, _add_at(dk, dk_blk.transpose(1, 0, 2)[None], at), _add_at(dv_, dv_blk.transpose(1, 0, 2)[None], at)

    if accumulate is None:  # float32 sums from zero, cast at the end
        shapes = ((batch, tq, heads, dqk), (batch, tk, kv_heads, dqk), (batch, tk, kv_heads, dv))
        accumulate = [jnp.zeros(shape, jnp.float32) for shape in shapes]
        dtypes = [grad_dtype or x.dtype for x in (q, k, v)]
    else:
        dtypes = [x.dtype for x in accumulate]
    # dq gains a term per block pair, so it sums in float32 (a no-op for the ring's); dk / dv once per key block
    dq0 = accumulate[0].astype(jnp.float32)
    sums = (pad(dq0, 1, bq), pad(accumulate[1], 1, bk), pad(accumulate[2], 1, bk))
    sums = lax.fori_loop(0, batch * nk, kv_block, sums)
    return tuple(x[:, :t].astype(dtype) for x, t, dtype in zip(sums, (tq, tk, tk), dtypes, strict=True))
