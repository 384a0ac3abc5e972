"""tokamax's flash attention for Hopper (Mosaic GPU; the optional `tokamax` extra, Python >= 3.12) behind the kernel
interface.

tokamax masks each query's keys by one range of key positions, [k_start, k_end). A call whose keys are in
increasing global order is such a range for every query, whatever order the queries are in: the keys at or before
the query's index are a prefix of the keys, and those of its document are the run that prefix ends with (a document
is one run of any increasing order of its tokens), cut at the window's edge. So one call serves the diagonal, a ring
step's pieces, dual_chunk halves and striped layouts, packed or not, with no per-kind branch. Keys out of order run
the general kernel (static indices: packed.Unservable; traced ones: a run-time branch), as do inputs that are not
16-bit. A non-causal call (a ring step whose keys all precede its queries, its indices meaning nothing) gives each
query its document's whole run, found by id where the ids increase along the row (checked at run time: a branch to
the general kernel).

- forward: tokamax returns out and each row's (max, sum) of exp; lse = max + log(sum), -inf with out 0 where a query
  sees nothing.
- backward: tokamax's VJP kernel given (max, sum) = (the final lse, 1), so that p = exp(s - lse): a ring step's
  backward from the merged out and lse. It computes delta = rowsum(dout * out) from out itself, so a dlse rides in two
  extra value columns (packed.with_dlse), only where something reads the lse.
- GQA native (dk / dv per key head); the value width may differ from the query's (MLA).
- tokamax picks its tiles for JAX's default device: each call traces with the parallelism's device as the default (a
  compile-only GPU when planning). Inside a shard_map its results are typed as the same on every device; they are
  given the mesh axes their inputs vary over (parallel/tokamax_calls.py).

`Library` holds the two calls; tests pass a dense stand-in with the same signature (tests/parallel/tokamax_standin.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallel import tokamax_calls
from parallel.kernels import blockwise, packed
from parallel.kernels.arguments import Options, Tokens
from parallel.kernels.packed import Unservable
from parallel.parallelism import current_parallelism


class Library(NamedTuple):
    """forward(q [b, tq, h, dqk], k [b, tk, hk, dqk], v [b, tk, hk, dv], k_start, k_end [b, tq] int32, *, scale) ->
    (out [b, tq, h, dv] in q's dtype, (max, sum) [b, h, tq] float32); backward(q, k, v, (max, sum), out, dout,
    k_start, k_end, *, scale) -> (dq, dk, dv). Query i sees keys k_start[i] <= j < k_end[i]."""

    forward: Callable
    backward: Callable


def missing() -> str | None:
    """Why tokamax's kernel cannot be called here (tokamax not installed), or None."""
    return None if tokamax_calls.installed() else f"attention kernel 'tokamax' needs tokamax: {tokamax_calls.INSTALL}"


def _attention_ops():
    """tokamax's Mosaic GPU attention module (imported at the first call: the extra is optional)."""
    from tokamax._src.ops.attention import pallas_mosaic_gpu

    tokamax_calls.quiet_cache_misses()

    return pallas_mosaic_gpu


def _mask(k_start, k_end):
    return _attention_ops().Mask(k_start=k_start[:, None, :], k_end=k_end[:, None, :])


def _forward(q, k, v, k_start, k_end, *, scale):
    axes = tokamax_calls.axes_of(q) | tokamax_calls.axes_of(k) | tokamax_calls.axes_of(v)
    with tokamax_calls.traced_for(current_parallelism().device):
        attention = _attention_ops().PallasMosaicGpuFlashAttention()
        out, residuals = attention(q, k, v, mask=_mask(k_start, k_end), logits_scale=scale, return_residuals=True)
    return jax.tree.map(lambda x: tokamax_calls.typed_as(x, axes), (out, residuals))


def _backward(q, k, v, residuals, out, dout, k_start, k_end, *, scale):
    ops = _attention_ops()
    with tokamax_calls.traced_for(current_parallelism().device):
        bound = ops.PallasMosaicGpuFlashAttention().bind(q, k, v, mask=_mask(k_start, k_end), logits_scale=scale)
        given = {name: value for name, value in bound.kwargs.items() if name != "return_residuals"}
        grads = ops.vjp.PallasMosaicGpuFlashAttentionVjp()(residuals, out, dout, *bound.args, **given)
    return tuple(
        tokamax_calls.typed_as(grads[name], tokamax_calls.axes_of(x)) for name, x in zip("qkv", (q, k, v), strict=True)
    )


TOKAMAX = Library(_forward, _backward)


def key_ranges(q_tokens: Tokens, kv_tokens: Tokens, options: Options):
    """Each query's visible keys as one range of key positions -> (k_start, k_end) [b, tq] int32, k_start == k_end
    where it sees none. Causal: the keys at or before a query are a prefix of keys in increasing order, and its
    document's keys among them the run of its segment id that ends the prefix. Not causal (indices then say nothing):
    its document's run, found by id in keys whose ids increase along the row (see _check)."""
    (q_seg, q_index), (kv_seg, kv_index) = q_tokens, kv_tokens
    tk = kv_seg.shape[1]
    positions = jnp.arange(tk, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones_like(kv_seg[:, :1], bool), kv_seg[:, 1:] != kv_seg[:, :-1]], axis=1)

    def own(at):
        """[b, tq] key positions -> (clipped positions, whether each is a key of the query's own document)."""
        clipped = jnp.clip(at, 0, tk - 1)
        same = (at >= 0) & (at < tk) & (q_seg > 0) & (jnp.take_along_axis(kv_seg, clipped, axis=1) == q_seg)
        return clipped, same

    if not options.causal:
        run_end = lax.cummin(jnp.where(jnp.roll(new_run, -1, axis=1).at[:, -1].set(True), positions + 1, tk),
                             axis=1, reverse=True)  # fmt: skip
        first = jax.vmap(functools.partial(jnp.searchsorted, side="left"))(_document_order(kv_seg), q_seg)
        first, found = own(first.astype(jnp.int32))
        start = jnp.where(found, first, 0)
        return start, jnp.where(found, jnp.take_along_axis(run_end, first, axis=1), 0)
    kv_index = jnp.asarray(kv_index, jnp.int32)
    split = jnp.broadcast_to(jnp.searchsorted(kv_index, q_index, side="right").astype(jnp.int32), q_seg.shape)
    run_start = lax.cummax(jnp.where(new_run, positions, 0), axis=1)
    last, last_own = own(split - 1)
    start = jnp.where(last_own, jnp.take_along_axis(run_start, last, axis=1), split)
    if options.window is not None:
        edge = jnp.searchsorted(kv_index, q_index - options.window, side="right").astype(jnp.int32)
        start = jnp.minimum(jnp.maximum(start, edge), split)
    return start, split


def _document_order(kv_seg):
    """[b, tk] ids -> [b, tk]: each key's id, padding (0) taking the largest id before it; non-decreasing along a
    row exactly when its documents' ids increase along it."""
    return lax.cummax(kv_seg, axis=1)


def _check(q, q_tokens: Tokens, kv_tokens: Tokens, options: Options, library: Library) -> bool | jax.Array:
    """Raises Unservable for calls the kernel never serves (not 16-bit where the library is tokamax's; causal with
    static key indices not increasing) -> True, or a traced bool where it is decided at run time: causal with traced
    key indices, they increase; not causal, every row's document ids increase along it."""
    if library is TOKAMAX and q.dtype not in (jnp.bfloat16, jnp.float16):
        raise Unservable(f"attention kernel 'tokamax' takes bfloat16 or float16 inputs, not {q.dtype}")
    if not options.causal:
        return _one_run_per_id(kv_tokens.segment_ids)
    static = packed.known_at_trace_time(kv_tokens.index)
    if static is None:
        return packed.increasing(kv_tokens.index)
    if not packed.increasing(static):
        raise Unservable("attention kernel 'tokamax' needs the keys in increasing global order; these are not")
    return True


def _one_run_per_id(kv_seg):
    """[b, tk] ids -> bool: along every row the documents' ids increase, each id one run (padding, 0, anywhere)."""
    pad = jnp.zeros_like(kv_seg[:, :1])
    before = jnp.concatenate([pad, lax.cummax(kv_seg, axis=1)[:, :-1]], axis=1)  # the largest id before each key
    previous = jnp.concatenate([pad, kv_seg[:, :-1]], axis=1)
    return jnp.all((kv_seg == 0) | (kv_seg > before) | ((kv_seg == before) & (kv_seg == previous)))


def _either(served: bool | jax.Array, call: Callable, general: Callable):
    """call() where `served` is True, else a run-time branch between call() and general() (static indices stay
    static in both: closures, not operands)."""
    return call() if served is True else lax.cond(served, call, general)


def forward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, *, options: Options, out_dtype=None, library=TOKAMAX,
    general=blockwise.forward,
):  # fmt: skip
    """parallel.kernels.blockwise.forward's arguments and results: (out [b, tq, h, dv] in `out_dtype` (default q's),
    lse [b, tq, h] float32). Raises Unservable for calls it cannot serve statically (see _check); keys whose traced
    indices do not increase, or whose ids do not in a non-causal call, run `general` (a forward of the same
    signature)."""
    served = _check(q, q_tokens, kv_tokens, options, library)

    def call():
        k_start, k_end = key_ranges(q_tokens, kv_tokens, options)
        out, (top, total) = library.forward(q, k, v, k_start, k_end, scale=options.scale)
        lse = jnp.where(total > 0, top + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
        return out.astype(q.dtype), jnp.swapaxes(lse, 1, 2).astype(jnp.float32)

    def general_call():
        return general(q, k, v, q_tokens, kv_tokens, options=options, out_dtype=q.dtype)

    out, lse = _either(served, call, general_call)
    return out.astype(out_dtype or q.dtype), lse


def backward(
    q, k, v, q_tokens: Tokens, kv_tokens: Tokens, out, lse, dout, dlse, *, options: Options, grad_dtype=None,
    accumulate=None, library=TOKAMAX, general=blockwise.backward,
):  # fmt: skip
    """parallel.kernels.blockwise.backward's arguments and results: (dq, dk, dv) given the final out / lse and their
    cotangents (dlse may be None), in `grad_dtype` (default q, k, v's dtypes), or added into `accumulate` sums in
    their dtypes. Raises Unservable as `forward` does; `general` a backward."""
    served = _check(q, q_tokens, kv_tokens, options, library)
    dv_width = v.shape[-1]

    def call():
        k_start, k_end = key_ranges(q_tokens, kv_tokens, options)
        sees = k_end > k_start
        width = dv_width if dlse is None else dv_width + 2
        padded_out, padded_dout = packed.with_dlse(out, dout, dlse, sees, width, q.dtype)
        top = jnp.swapaxes(packed.where(sees[..., None], lse.astype(jnp.float32), jnp.inf), 1, 2)
        residuals = (top, jnp.ones_like(top))
        padded_v = packed.pad_last(v, width)
        grads = library.backward(
            q, k, padded_v, residuals, padded_out, padded_dout, k_start, k_end, scale=options.scale
        )
        dq, dk, dv = (g.astype(jnp.float32) for g in grads)
        return dq, dk, dv[..., :dv_width]

    def general_call():
        return general(q, k, v, q_tokens, kv_tokens, out, lse, dout, dlse, options=options, grad_dtype=jnp.float32)

    grads = _either(served, call, general_call)
    if accumulate is not None:
        return tuple((total + g).astype(total.dtype) for total, g in zip(accumulate, grads, strict=True))
    return tuple(g.astype(grad_dtype or x.dtype) for g, x in zip(grads, (q, k, v), strict=True))
