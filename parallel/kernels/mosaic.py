"""Flash attention as Pallas kernels on Mosaic GPU (Hopper's warpgroup matrix multiplies and TMA copies), with the
blockwise kernel's semantics: separate query and key segment ids, causality and sliding windows by global token
index, GQA without repeating key / value heads, query-key and value head dims that differ, lse out and its
cotangent in. parallel.kernels.pallas runs them on Hopper for the calls `serves` takes (Triton for the rest).

Three kernels: the forward and dq (grid heads x query blocks x batch, a loop over key blocks) and dk / dv (grid
key-value heads x key blocks x batch, one loop over the query blocks x the group's query heads, so no sum over the
group afterwards). A block is one warpgroup's 64 rows (the matrix multiply's M). Each loop runs over the range of
blocks that may hold a visible pair (block summaries reduced in one XLA fusion: O(T / 64) numbers out) and skips the
blocks inside it that share no segment or lie outside the causal bound or the window (checked per block on the same
summaries); the next visible block's copy is issued before the current one is computed (two slots). Head dims are
zero-padded to multiples of 64 (one 128-byte swizzled row of bf16) and lengths to whole blocks; padded tokens are
segment 0. dk / dv's outputs share shared memory with its slots (as dq's and the forward's), and past SPLIT it runs as
a dk and a dv kernel.

Compiled for an H100 (MOSAIC_GPU_DUMP_PTXAS=1 prints ptxas' report; XLA reports no spills): no register spills in
bfloat16 at head dims 64, 128, MLA's 192 / 128 and 256; with float32 gradients (the ring's running sums) 20 to 210
bytes at 192 / 128 and 256. Not yet run on a GPU. On CPU the kernels run in JAX's Mosaic GPU interpreter (JAX 0.12;
tests/parallel/test_mosaic_kernel.py), whose matrix multiply takes its left operand from shared memory only: there P
and dS are staged through it (`_accumulate`), where the GPU keeps them in registers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from parallel import segments
from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.blockwise import block_ranges, pad, pad_keys, pad_queries
from parallel.kernels.softmax import backward_delta
from parallel.rounding import round_up

BLOCK = 64  # rows of one warpgroup's matrix multiply: the query and key block of every kernel
SHARED_MEMORY = 224 << 10  # of the 227 KiB an H100 block may use: the rest for the token vectors
# padded dqk + dv past which dk and dv run as two kernels (S computed in both): together their float32
# accumulators would take (dqk + dv) / 2 of a thread's 255 registers
SPLIT = 384
ROWS = plgpu.Layout.WGMMA.reduce(1)  # [m] vectors along a score tile's rows
COLUMNS = plgpu.Layout.WGMMA.reduce(0)  # [n] vectors along its columns


def serves(q, k, v, out_itemsize: int) -> bool:
    """Whether these kernels take q, k, v (one 16-bit dtype, the matrix multiplies' operands) with outputs of
    `out_itemsize` bytes: head dims up to 256 (the multiplies' widest N), and within shared memory, where dq and
    dk / dv, the largest, hold one side's blocks and two slots of the other's, the outputs sharing the slots."""
    dtypes = {x.dtype for x in (q, k, v)}
    if dtypes - {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)} or len(dtypes) != 1:
        return False
    dqk, dv = round_up(q.shape[-1], 64), round_up(v.shape[-1], 64)
    itemsize = q.dtype.itemsize
    return max(dqk, dv) <= 256 and BLOCK * (dqk + dv) * (itemsize + max(2 * itemsize, out_itemsize)) <= SHARED_MEMORY


def _smem(shape, dtype):
    """Shared memory a matrix multiply reads: 128-byte swizzled rows."""
    columns = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(128)))


class Summary(NamedTuple):
    """Segment-id and global-index range of blocks (parallel.segments.BlockSummary without `padded`): smallest
    non-zero id and largest id [batch, n], smallest and largest index [n]; in a kernel, one block's scalars."""

    seg_min: jax.Array
    seg_max: jax.Array
    index_min: jax.Array
    index_max: jax.Array

    def at(self, b, i) -> Summary:
        """Block i of row b, read from the kernel's GMEM refs."""
        return Summary(self.seg_min[b, i], self.seg_max[b, i], self.index_min[i], self.index_max[i])


class Static(NamedTuple):
    causal: bool
    window: int | None
    scale: float
    group: int  # query heads a key-value head


class Operands(NamedTuple):
    """What every kernel reads (a pytree of GMEM refs inside): padded q [b, tq, h, dqk], k [b, tk, hkv, dqk],
    v [b, tk, hkv, dv], both sides' tokens and block summaries; the backward's dout [b, tq, h, dv] and lse / delta
    [b, h, tq] float32 (None in the forward)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_tokens: Tokens
    kv_tokens: Tokens
    q_blocks: Summary
    kv_blocks: Summary
    dout: jax.Array | None = None
    lse: jax.Array | None = None
    delta: jax.Array | None = None


def _ranges(q: Summary, kv: Summary, options: Options, over: str) -> jax.Array:
    """[batch, n, 2] int32: for each block of one side, the first block of the other (`over`: "kv" or "q") that may
    hold a visible pair with it and one past the last (equal when none)."""
    full = lambda s: segments.BlockSummary(*s, padded=None)
    visible = segments.visible_blocks(full(q), full(kv), causal=options.causal, window=options.window)
    return jnp.stack(block_ranges(jnp.swapaxes(visible, 1, 2) if over == "q" else visible), -1)


def _mask(q_vectors, kv_vectors, shape, q_axis: int, static: Static):
    """[shape] visibility of a score tile from its queries' and keys' [2, BLOCK] token vectors (segment ids,
    indices) in shared memory, the queries along `q_axis`."""
    kv_axis = 1 - q_axis
    layouts = (ROWS, COLUMNS) if q_axis == 0 else (COLUMNS, ROWS)
    q_seg, q_index = (_vector(q_vectors.at[r], layouts[0]) for r in (0, 1))
    kv_seg, kv_index = (_vector(kv_vectors.at[r], layouts[1]) for r in (0, 1))
    side = lambda seg, index, axis: Tokens(*(lax.broadcast_in_dim(x, shape, [axis]) for x in (seg, index)))
    q, kv = side(q_seg, q_index, q_axis), side(kv_seg, kv_index, kv_axis)
    return segments.visible_pairs(q, kv, causal=static.causal, window=static.window)


def _vector(ref, layout):
    """A [BLOCK] vector in shared memory, in the layout of a score tile's rows or columns."""
    return plgpu.layout_cast(ref[...], layout)


def _scores(lhs, rhs_transposed, shape):
    """lhs [m, d] @ rhs [n, d]^T (both shared memory) -> [m, n] float32 in registers."""

    def multiply(acc):
        plgpu.wgmma(acc, lhs, rhs_transposed.transpose((1, 0)))
        return acc[...]

    return pl.run_scoped(multiply, plgpu.ACC(shape, jnp.float32))


def _accumulate(acc, lhs, rhs, staging):
    """acc + lhs @ rhs: lhs [m, k] registers, rhs [k, n] shared memory. Staged (the interpreter) through shared
    memory into a fresh accumulator; on the GPU lhs stays in registers and acc accumulates in place."""
    if staging is None:

        def multiply(acc_ref):
            plgpu.wgmma(acc_ref, lhs, rhs)

        return pl.run_state(multiply)(plgpu.ACC.init(acc))
    staging[...] = lhs
    plgpu.commit_smem()

    def fresh(acc_ref):
        plgpu.wgmma(acc_ref, staging, rhs)
        return acc_ref[...]

    return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))


def _zeros(*shape, layout=plgpu.Layout.WGMMA):
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)


def _copy(pairs, barrier):
    """Issues the copies (GMEM view, SMEM) that all arrive on one barrier (of as many arrivals)."""
    for source, target in pairs:
        plgpu.copy_gmem_to_smem(source, target, barrier)


def _tokens(tokens: Tokens, b, at, vectors) -> list:
    """The copies of a block's segment ids and global indices into its [2, BLOCK] token vectors."""
    return [(tokens.segment_ids.at[b, at], vectors.at[0]), (tokens.index.at[at], vectors.at[1])]


def _keys(x: Operands, b, kv_head, slots, barriers):
    """fetch(j, slot): the copies of key block j (K, V, token vectors) into `slots` = (k, v, vectors) [2, ...]."""
    k_smem, v_smem, vectors = slots

    def fetch(j, slot):
        cols = pl.ds(j * BLOCK, BLOCK)
        copies = [(x.k.at[b, cols, kv_head], k_smem.at[slot]), (x.v.at[b, cols, kv_head], v_smem.at[slot])]
        _copy(copies + _tokens(x.kv_tokens, b, cols, vectors.at[slot]), barriers.at[slot])

    return fetch


def _loop(lo, hi, visible, fetch, compute, carry):
    """Runs compute(n, slot, carry) for each visible n in [lo, hi) (lo visible: a range's first block), the copy
    of the next visible one issued first (fetch(n, slot)); slots alternate over visible blocks only, so each slot's
    barrier is waited on once per copy."""

    @pl.when(lo < hi)
    def _():
        fetch(lo, 0)

    def step(n, state):
        count, this, carry = state
        following = (n + 1 < hi) & visible(jnp.minimum(n + 1, hi - 1))  # no summary read past the range

        @pl.when(following)
        def _():
            fetch(n + 1, lax.rem(count + this.astype(jnp.int32), 2))

        carry = lax.cond(this, lambda c: compute(n, lax.rem(count, 2), c), lambda c: c, carry)
        return count + this.astype(jnp.int32), following, carry

    return lax.fori_loop(lo, hi, step, (jnp.int32(0), lo < hi, carry))[2]


def _forward_kernel(x: Operands, ranges, out_ref, lse_ref, scratch, *, static: Static):
    (q_smem, q_vectors), (slots, (o_smem, lse_smem)), staging, (held, barriers) = scratch
    h, i, b = lax.axis_index("heads"), lax.axis_index("q"), lax.axis_index("batch")
    rows = pl.ds(i * BLOCK, BLOCK)
    _copy([(x.q.at[b, rows, h], q_smem), *_tokens(x.q_tokens, b, rows, q_vectors)], held)
    fetch = _keys(x, b, lax.div(h, jnp.array(static.group, h.dtype)), slots, barriers)
    k_smem, v_smem, kv_vectors = slots
    shape = (BLOCK, BLOCK)
    plgpu.barrier_wait(held)

    def compute(j, slot, carry):
        acc, row_max, row_sum = carry
        plgpu.barrier_wait(barriers.at[slot])
        s = _scores(q_smem, k_smem.at[slot], shape) * static.scale
        s = jnp.where(_mask(q_vectors, kv_vectors.at[slot], shape, 0, static), s, -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(axis=1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        p = jnp.exp(s - lax.broadcast_in_dim(safe_max, shape, [0]))
        correction = jnp.exp(row_max - safe_max)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
        acc = _accumulate(acc, p.astype(k_smem.dtype), v_smem.at[slot], staging)
        return acc, new_max, row_sum * correction + p.sum(axis=1)

    block = x.q_blocks.at(b, i)
    visible = lambda j: segments.may_see(block, x.kv_blocks.at(b, j), causal=static.causal, window=static.window)
    minus_inf = plgpu.layout_cast(jnp.full((BLOCK,), -jnp.inf, jnp.float32), ROWS)
    init = (_zeros(BLOCK, v_smem.shape[-1]), minus_inf, _zeros(BLOCK, layout=ROWS))
    acc, row_max, row_sum = _loop(ranges[b, i, 0], ranges[b, i, 1], visible, fetch, compute, init)
    seen = row_sum > 0
    safe_sum = jnp.where(seen, row_sum, 1.0)
    o_smem[...] = (acc / lax.broadcast_in_dim(safe_sum, acc.shape, [0])).astype(o_smem.dtype)
    lse_smem[...] = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, rows, h])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, rows])
    plgpu.wait_smem_to_gmem(0)


def _dq_kernel(x: Operands, ranges, dq_ref, scratch, *, static: Static):
    (q_smem, do_smem, q_vectors, stats), (slots, dq_smem), staging, (held, barriers) = scratch
    h, i, b = lax.axis_index("heads"), lax.axis_index("q"), lax.axis_index("batch")
    rows = pl.ds(i * BLOCK, BLOCK)
    copies = [(x.q.at[b, rows, h], q_smem), (x.dout.at[b, rows, h], do_smem)]
    copies += [(x.lse.at[b, h, rows], stats.at[0]), (x.delta.at[b, h, rows], stats.at[1])]
    _copy(copies + _tokens(x.q_tokens, b, rows, q_vectors), held)
    fetch = _keys(x, b, lax.div(h, jnp.array(static.group, h.dtype)), slots, barriers)
    k_smem, v_smem, kv_vectors = slots
    shape = (BLOCK, BLOCK)
    plgpu.barrier_wait(held)
    lse, delta = _vector(stats.at[0], ROWS), _vector(stats.at[1], ROWS)
    lse = jnp.where(lse == -jnp.inf, 0.0, lse)

    def compute(j, slot, dq):
        plgpu.barrier_wait(barriers.at[slot])
        s = _scores(q_smem, k_smem.at[slot], shape) * static.scale
        mask = _mask(q_vectors, kv_vectors.at[slot], shape, 0, static)
        p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(lse, shape, [0])), 0.0)
        dp = _scores(do_smem, v_smem.at[slot], shape)
        ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))
        return _accumulate(dq, ds.astype(k_smem.dtype), k_smem.at[slot], staging)

    block = x.q_blocks.at(b, i)
    visible = lambda j: segments.may_see(block, x.kv_blocks.at(b, j), causal=static.causal, window=static.window)
    dq = _loop(ranges[b, i, 0], ranges[b, i, 1], visible, fetch, compute, _zeros(BLOCK, q_smem.shape[-1]))
    dq_smem[...] = (dq * static.scale).astype(dq_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[b, rows, h])
    plgpu.wait_smem_to_gmem(0)


def _dkdv_kernel(x: Operands, ranges, *refs, static: Static, wanted: tuple[str, ...]):
    """dk and / or dv (`wanted`: their output refs in that order, then the scratch) of one key block."""
    *out_refs, scratch = refs
    (k_smem, v_smem, kv_vectors), (streamed, out_smem), staging, (held, barriers) = scratch
    q_smem, do_smem, q_vectors, stats = streamed
    g, j, b = lax.axis_index("heads"), lax.axis_index("kv"), lax.axis_index("batch")
    cols = pl.ds(j * BLOCK, BLOCK)
    copies = [(x.k.at[b, cols, g], k_smem), (x.v.at[b, cols, g], v_smem)]
    _copy(copies + _tokens(x.kv_tokens, b, cols, kv_vectors), held)

    def fetch(n, slot):  # query block n // group of query head g * group + n % group
        rows, h = pl.ds(lax.div(n, static.group) * BLOCK, BLOCK), g * static.group + lax.rem(n, static.group)
        copies = [(x.q.at[b, rows, h], q_smem.at[slot]), (x.dout.at[b, rows, h], do_smem.at[slot])]
        copies += [(x.lse.at[b, h, rows], stats.at[slot, 0]), (x.delta.at[b, h, rows], stats.at[slot, 1])]
        _copy(copies + _tokens(x.q_tokens, b, rows, q_vectors.at[slot]), barriers.at[slot])

    shape = (BLOCK, BLOCK)  # [keys, queries]: the transposed scores
    plgpu.barrier_wait(held)

    def compute(n, slot, carry):
        grads = dict(zip(wanted, carry, strict=True))
        plgpu.barrier_wait(barriers.at[slot])
        lse, delta = (_vector(stats.at[slot, r], COLUMNS) for r in (0, 1))
        lse = jnp.where(lse == -jnp.inf, 0.0, lse)
        s = _scores(k_smem, q_smem.at[slot], shape) * static.scale
        mask = _mask(q_vectors.at[slot], kv_vectors, shape, 1, static)
        p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(lse, shape, [1])), 0.0)
        if "dv" in grads:
            grads["dv"] = _accumulate(grads["dv"], p.astype(v_smem.dtype), do_smem.at[slot], staging)
        if "dk" in grads:
            dp = _scores(v_smem, do_smem.at[slot], shape)
            ds = p * (dp - lax.broadcast_in_dim(delta, shape, [1]))
            grads["dk"] = _accumulate(grads["dk"], ds.astype(k_smem.dtype), q_smem.at[slot], staging)
        return tuple(grads[name] for name in wanted)

    block = x.kv_blocks.at(b, j)
    visible = lambda n: segments.may_see(
        x.q_blocks.at(b, lax.div(n, static.group)), block, causal=static.causal, window=static.window
    )
    lo, hi = ranges[b, j, 0] * static.group, ranges[b, j, 1] * static.group
    widths, scales = {"dk": k_smem.shape[-1], "dv": v_smem.shape[-1]}, {"dk": static.scale, "dv": 1.0}
    grads = _loop(lo, hi, visible, fetch, compute, tuple(_zeros(BLOCK, widths[name]) for name in wanted))
    for name, grad, smem in zip(wanted, grads, out_smem, strict=True):
        smem[...] = (grad * scales[name]).astype(smem.dtype)
    plgpu.commit_smem()
    for smem, ref in zip(out_smem, out_refs, strict=True):
        plgpu.copy_smem_to_gmem(smem, ref.at[b, cols, g])
    plgpu.wait_smem_to_gmem(0)


def _operands(q, k, v, q_tokens: Tokens, kv_tokens: Tokens) -> Operands:
    """Lengths padded to whole blocks (padded tokens: segment 0; key indices INT32_MAX, query indices the largest,
    so no block's range grows: parallel.kernels.blockwise.pad_queries / pad_keys), head dims to multiples of 64."""
    int32 = lambda t: Tokens(t.segment_ids.astype(jnp.int32), jnp.asarray(t.index, jnp.int32))
    q_tokens, kv_tokens = pad_queries(int32(q_tokens), BLOCK), pad_keys(int32(kv_tokens), BLOCK)
    summary = lambda t: Summary(*segments.block_summary(t.segment_ids, t.index, BLOCK)[:4])
    q, k, v = pad(pad(q, 1, BLOCK), 3, 64), pad(pad(k, 1, BLOCK), 3, 64), pad(pad(v, 1, BLOCK), 3, 64)
    return Operands(q, k, v, q_tokens, kv_tokens, summary(q_tokens), summary(kv_tokens))


def _union(slots, outputs):
    """The streamed side's two slots and the outputs in one region of shared memory: the outputs are written after
    the loop, when every copy into the slots has been waited on and every read of them done."""
    return plgpu.RefUnion(slots, outputs)


def _barriers(held: int, streamed: int) -> tuple:
    """The held block's barrier and the two slots' (each awaiting its side's copies)."""
    return plgpu.Barrier(num_arrivals=held), plgpu.Barrier(num_arrivals=streamed, num_barriers=2)


def _call(name, body, out_type, grid, axes, scratch, interpret, *args):
    """Runs `body` as a Mosaic GPU kernel in the scope `name` (what train/planning/speed.py costs it by)."""
    extra = {} if interpret is None else {"interpret": interpret}
    kernel = plgpu.kernel(body, out_type=out_type, grid=grid, grid_names=axes, scratch_types=[scratch], **extra)
    with jax.named_scope(name):
        return kernel(*args)


def forward(q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, interpret=None, out_dtype=None):
    """parallel.kernels.blockwise.forward's arguments and results: (out [batch, tq, heads, dv] in `out_dtype`
    (default q's), lse [batch, tq, heads] float32). `interpret`: plgpu's interpret params (CPU), None on the GPU."""
    batch, tq, heads, _ = q.shape
    dv, out_dtype = v.shape[-1], out_dtype or q.dtype
    x = _operands(q, k, v, q_tokens, kv_tokens)
    (_, tq_pad, _, dqk_pad), dv_pad, dtype = x.q.shape, x.v.shape[-1], q.dtype
    static = Static(options.causal, options.window, options.scale, heads // k.shape[2])
    scratch = (
        (_smem((BLOCK, dqk_pad), dtype), plgpu.SMEM((2, BLOCK), jnp.int32)),
        _union(
            (_smem((2, BLOCK, dqk_pad), dtype), _smem((2, BLOCK, dv_pad), dtype), plgpu.SMEM((2, 2, BLOCK), jnp.int32)),
            (_smem((BLOCK, dv_pad), out_dtype), plgpu.SMEM((BLOCK,), jnp.float32)),
        ),
        None if interpret is None else _smem((BLOCK, BLOCK), dtype),
        _barriers(3, 4),
    )
    out_type = (
        jax.ShapeDtypeStruct((batch, tq_pad, heads, dv_pad), out_dtype),
        jax.ShapeDtypeStruct((batch, heads, tq_pad), jnp.float32),
    )
    ranges = _ranges(x.q_blocks, x.kv_blocks, options, over="kv")
    body = functools.partial(_forward_kernel, static=static)
    grid = (heads, tq_pad // BLOCK, batch)
    out, lse = _call("attention_forward", body, out_type, grid, ("heads", "q", "batch"), scratch, interpret, x, ranges)
    return out[:, :tq, :, :dv], jnp.swapaxes(lse, 1, 2)[:, :tq]


def backward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, out, lse, dout, dlse, *, options: Options, interpret=None,
    grad_dtype=None, delta=None,
):  # fmt: skip
    """parallel.kernels.blockwise.backward's arguments and results: (dq, dk, dv) of `forward` given its final out /
    lse and their cotangents (dlse may be None) or the rows' `delta`, in `grad_dtype` (default: q, k, v's dtypes)."""
    (batch, tq, heads, dqk), (_, tk, kv_heads, dv) = q.shape, v.shape
    # d score = p (dp - delta), delta = dout . out - dlse (see parallel.kernels.blockwise.backward)
    delta = backward_delta(out, dout, dlse) if delta is None else delta
    dq_dtype, dk_dtype, dv_dtype = (grad_dtype or x.dtype for x in (q, k, v))
    x = _operands(q, k, v, q_tokens, kv_tokens)
    (_, tq_pad, _, dqk_pad), (_, tk_pad, _, dv_pad), dtype = x.q.shape, x.v.shape, q.dtype
    by_head = lambda y: jnp.swapaxes(pad(y, 1, BLOCK), 1, 2)  # [batch, heads, tq]
    x = x._replace(dout=pad(pad(dout.astype(dtype), 1, BLOCK), 3, 64), lse=by_head(lse), delta=by_head(delta))
    static = Static(options.causal, options.window, options.scale, heads // kv_heads)
    staging = None if interpret is None else _smem((BLOCK, BLOCK), dtype)
    q_side = lambda *slots: (  # Q, dO, token vectors, lse / delta
        _smem((*slots, BLOCK, dqk_pad), dtype), _smem((*slots, BLOCK, dv_pad), dtype),
        plgpu.SMEM((*slots, 2, BLOCK), jnp.int32), plgpu.SMEM((*slots, 2, BLOCK), jnp.float32),
    )  # fmt: skip
    kv_side = lambda *slots: (  # K, V, token vectors
        _smem((*slots, BLOCK, dqk_pad), dtype), _smem((*slots, BLOCK, dv_pad), dtype),
        plgpu.SMEM((*slots, 2, BLOCK), jnp.int32),
    )  # fmt: skip
    scratch = (q_side(), _union(kv_side(2), _smem((BLOCK, dqk_pad), dq_dtype)), staging, _barriers(6, 4))
    body = functools.partial(_dq_kernel, static=static)
    grid, axes = (heads, tq_pad // BLOCK, batch), ("heads", "q", "batch")
    out_type = jax.ShapeDtypeStruct(x.q.shape, dq_dtype)
    ranges = _ranges(x.q_blocks, x.kv_blocks, options, over="kv")
    dq = _call("attention_dq", body, out_type, grid, axes, scratch, interpret, x, ranges)
    grid, axes = (kv_heads, tk_pad // BLOCK, batch), ("heads", "kv", "batch")
    ranges = _ranges(x.q_blocks, x.kv_blocks, options, over="q")
    outputs = {"dk": (x.k.shape, dk_dtype), "dv": (x.v.shape, dv_dtype)}
    grads = {}
    for wanted in (("dk", "dv"),) if dqk_pad + dv_pad <= SPLIT else (("dk",), ("dv",)):
        out_smem = tuple(_smem((BLOCK, outputs[name][0][-1]), outputs[name][1]) for name in wanted)
        scratch = (kv_side(), _union(q_side(2), out_smem), staging, _barriers(4, 6))
        body = functools.partial(_dkdv_kernel, static=static, wanted=wanted)
        out_type = tuple(jax.ShapeDtypeStruct(*outputs[name]) for name in wanted)
        name = "attention_" + "".join(wanted)
        grads.update(zip(wanted, _call(name, body, out_type, grid, axes, scratch, interpret, x, ranges), strict=True))
    return dq[:, :tq, :, :dqk], grads["dk"][:, :tk, :, :dqk], grads["dv"][:, :tk, :, :dv]
