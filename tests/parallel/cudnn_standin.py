"""A dense stand-in for JAX's cuDNN attention primitives (the fwd / bwd wrappers' binds), for CPU tests.

Same operands, parameters and results. Metadata goes through JAX's own `_fix_seqlen_offsets` (left-shifted lists,
element offsets scaled by the query head count and head dim) and is read back the way the packed layout reads it:
segment s's Q / O start at element offset q_offsets[s] of tensors strided by their own heads x head dim, K / V at
kv_offsets[s]. So an offset that is no whole token of a tensor (GQA K / V, a V head dim unlike Q's) poisons the
segment with NaN. Masks: segment (the packed run) and, for the causal types, top-left causal within it. Tokens
in no segment and stats entries no token fills come back NaN, like the real kernel's uninitialised memory.
"""

import functools

import jax.numpy as jnp

from parallel import compat, kernels
from parallel.kernels import blockwise, cudnn

fa = compat.cudnn_attention()  # JAX's private cuDNN module: its metadata helper and enums


def _segments(query, key, value, q_seqlen, kv_seqlen, q_offsets, kv_offsets):
    """Per packed segment s, for S = batch * max segments: token rows (flat over batch x length) of Q, O, K, V as
    [S, T] / [S, Tk] int32, -1 past the segment; and [S] bool, a segment whose offset is no whole token of one of
    those tensors or runs past its end."""
    q_len, kv_len, q_off, kv_off = fa._fix_seqlen_offsets(q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key)
    segments = q_len.size
    q_len, kv_len = q_len.reshape(-1), kv_len.reshape(-1)
    q_off, kv_off = q_off.reshape(-1)[:segments], kv_off.reshape(-1)[:segments]

    def rows(offset, length, shape):
        """(rows [S, t], broken [S]) of a [b, t, heads, d] tensor."""
        stride = shape[2] * shape[3]
        start = offset // stride
        broken = (length > 0) & ((offset % stride != 0) | (start + length > shape[0] * shape[1]))
        pos = jnp.arange(shape[1])
        return jnp.where(pos[None] < length[:, None], start[:, None] + pos[None], -1), broken

    o_shape = (*query.shape[:3], value.shape[3])
    parts = [
        rows(q_off, q_len, query.shape),
        rows(q_off, q_len, o_shape),
        rows(kv_off, kv_len, key.shape),
        rows(kv_off, kv_len, value.shape),
    ]
    return [r for r, _ in parts], parts[0][1] | parts[1][1] | parts[2][1] | parts[3][1]


def _gather(x, rows):
    """x [b, t, heads, d], rows [S, n] -> float32 [S, n, heads, d] (zeros where rows < 0)."""
    flat = x.reshape(-1, *x.shape[2:]).astype(jnp.float32)
    return jnp.where((rows >= 0)[..., None, None], flat[jnp.maximum(rows, 0)], 0.0)


def _scatter(shape, rows, values, dtype):
    """float32 values [S, n, heads, d] placed at `rows` of a NaN [b, t, heads, d] array."""
    flat = jnp.full((shape[0] * shape[1], *shape[2:]), jnp.nan, jnp.float32)
    flat = flat.at[jnp.where(rows >= 0, rows, flat.shape[0])].set(values, mode="drop")
    return flat.reshape(shape).astype(dtype)


def _probabilities(q, k, q_rows, k_rows, stats, scale, mask_type):
    """Scores' softmax weights [S, heads, T, Tk] given stats [S, heads, T] (None: computed), and the stats."""
    group = q.shape[2] // k.shape[2]
    s = jnp.einsum("sqhd,skhd->shqk", q, jnp.repeat(k, group, axis=2), precision="highest") * scale
    mask = (q_rows >= 0)[:, None, :, None] & (k_rows >= 0)[:, None, None, :]
    if mask_type in (fa.MaskType.CAUSAL, fa.MaskType.PADDING_CAUSAL):
        mask &= jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    s = jnp.where(mask, s, -jnp.inf)
    if stats is None:
        stats = jnp.max(s, -1) + jnp.log(jnp.sum(jnp.exp(s - jnp.max(s, -1, keepdims=True)), -1))
    return jnp.where(mask, jnp.exp(s - stats[..., None]), 0.0), stats


def _check_unused(bias, page_k, page_v, params):
    """The operands the real lowering drops: no bias (variadic_args) and no paging (rank-4 page tables); none of them
    zero-element (parallel/kernels/cudnn.py: a zero-element shard_map operand crashes XLA's Shardy import)."""
    assert params["variadic_args"] == (False, False) and fa.check_is_paged_attention(page_k) is False
    assert all(x.size > 0 for x in (bias, page_k, page_v))


def forward(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_k, page_v, **params):
    """The fwd wrapper's bind: -> [out [b, tq, heads, dv], stats [S, heads, tq] float32]."""
    assert params["layout"] == fa.AttentionLayout.BTNH.value and params["is_training"]
    _check_unused(bias, page_k, page_v, params)
    (q_rows, o_rows, k_rows, v_rows), broken = _segments(query, key, value, q_seqlen, kv_seqlen, q_offsets, kv_offsets)
    q, k, v = _gather(query, q_rows), _gather(key, k_rows), _gather(value, v_rows)
    p, stats = _probabilities(q, k, q_rows, k_rows, None, params["scale"], params["mask_type"])
    group = query.shape[2] // key.shape[2]
    out = jnp.einsum("shqk,skhd->sqhd", p, jnp.repeat(v, group, axis=2), precision="highest")
    out = jnp.where(broken[:, None, None, None], jnp.nan, out)
    stats = jnp.where(broken[:, None, None] | (q_rows < 0)[:, None, :], jnp.nan, stats)
    out = _scatter((*query.shape[:3], value.shape[3]), o_rows, out, query.dtype)
    return [out, stats]


def backward(query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_k, page_v, stats, out, dout,
             **params):  # fmt: skip
    """The bwd wrapper's bind: -> [dq, dk, dv] in the inputs' shapes and dtypes; delta = dout . out per row."""
    _check_unused(bias, page_k, page_v, params)
    (q_rows, o_rows, k_rows, v_rows), broken = _segments(query, key, value, q_seqlen, kv_seqlen, q_offsets, kv_offsets)
    q, k, v = _gather(query, q_rows), _gather(key, k_rows), _gather(value, v_rows)
    o, do = _gather(out, o_rows), _gather(dout, o_rows)
    p, _ = _probabilities(q, k, q_rows, k_rows, stats, params["scale"], params["mask_type"])
    group = query.shape[2] // key.shape[2]
    dp = jnp.einsum("sqhd,skhd->shqk", do, jnp.repeat(v, group, axis=2), precision="highest")
    delta = jnp.einsum("sqhd,sqhd->shq", do, o, precision="highest")
    ds = jnp.where(broken[:, None, None, None], jnp.nan, p * (dp - delta[..., None]) * params["scale"])
    dq = jnp.einsum("shqk,skhd->sqhd", ds, jnp.repeat(k, group, axis=2), precision="highest")

    def per_kv_head(x):
        """[S, Tk, heads, d] -> [S, Tk, kv_heads, d] summed over each group."""
        return x.reshape(*x.shape[:2], key.shape[2], group, x.shape[-1]).sum(3)

    dk = per_kv_head(jnp.einsum("shqk,sqhd->skhd", ds, q, precision="highest"))
    dv = per_kv_head(jnp.einsum("shqk,sqhd->skhd", p, do, precision="highest"))
    return [
        _scatter(query.shape, q_rows, dq, query.dtype),
        _scatter(key.shape, k_rows, dk, key.dtype),
        _scatter(value.shape, v_rows, dv, value.dtype),
    ]


STANDIN = cudnn.Primitives(forward, backward)


def _poisoned(kernel):
    """`kernel` (a blockwise.forward / backward) with every result NaN: a call that runs it shows in the output."""

    def call(*args, **kwargs):
        return tuple(x * jnp.nan for x in kernel(*args, **kwargs))

    return call


def serve_cudnn_with_standin(monkeypatch):
    """From here on (in this test), `kernels.select("cudnn")` on any backend gives the cuDNN kernel on the stand-in
    primitives (serve_with_standin)."""
    serve_with_standin(monkeypatch, "cudnn", cudnn, primitives=STANDIN)


def serve_with_standin(monkeypatch, name: str, module, max_segments: int | None = 16, **standin):
    """From here on (in this test), `kernels.select(name)` on any backend gives the kernel of `module` (cudnn, flash3,
    tokamax_attention) with the stand-in `standin` keywords (and `max_segments`, a test row's documents, where not
    None), and the blockwise kernel behind it returns NaN: an attention run is finite only if the kernel served every
    call (static calls it cannot serve raise packed.Unservable)."""
    select = kernels.select
    segments = {} if max_segments is None else dict(max_segments=max_segments)

    def standin_select(kernel="auto", *, interpret=False, backend=None, capability=None):
        if kernel != name:
            return select(kernel, interpret=interpret, backend=backend, capability=capability)
        forward, backward = (
            functools.partial(f, **standin, **segments, general=_poisoned(fallback))
            for f, fallback in ((module.forward, blockwise.forward), (module.backward, blockwise.backward))
        )
        return kernels.Kernel(name, forward, backward)

    monkeypatch.setattr(kernels, "select", standin_select)
