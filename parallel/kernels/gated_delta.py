"""The gated delta rule (Gated DeltaNet's recurrence) in chunks: per head, a state S [dk, dv] that each token t updates

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t,

and that a document start resets (S_{t-1} := 0 where the segment id changes), so packed rows never leak state.

Chunks of `chunk` tokens: inside a chunk every token-to-token term is a matmul (the WY form: one unit lower triangular
solve gives w and u, with u - w S the chunk's corrected values), and one scan over the chunks carries S. A reset is
the limit g_t -> -inf, written as masks (decay factors of token pairs in different documents are 0; the chunk's
incoming state reaches only tokens of the document it belongs to), so nothing computes -inf - -inf. Everything runs
in float32. Memory is O(length): the chunk terms are [chunks, chunk, chunk] per head and the scan keeps one state per
chunk.

The recurrence is affine in the incoming state: running it on values [0 | v] from [I | 0] gives [M | E], the map
S_out = M S_in + E of a piece of the row (parallel/recurrent.py splits the row over devices with it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

CHUNK = 64


def chunked(q, k, v, g, beta, seg, *, state, start_seg, chunk: int = CHUNK, outputs: bool = True):
    """q, k: [batch, length, heads, dk] (q already scaled; None when not `outputs`), v: [batch, length, heads, dv],
    g (log decay, <= 0) and beta: [batch, length, heads], seg: [batch, length] int32 (a change of id starts a
    document); state: [batch, heads, dk, dv] float32, the state before the first token, belonging to the document
    of id start_seg [batch] (an id no token has: no state carries in) -> (out [batch, length, heads, dv] float32, or
    None when not `outputs`; the state after the last token [batch, heads, dk, dv] float32)."""
    length = k.shape[1]
    pad = -length % chunk
    if pad:  # identity tokens (no decay, no write) of the last document
        widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        q, k, v, g, beta = (None if x is None else jnp.pad(x, widths(x)) for x in (q, k, v, g, beta))
        seg = jnp.pad(seg, [(0, 0), (0, pad)], mode="edge")
    terms = _chunk_terms(q, k, v, g, beta, seg, start_seg, chunk, outputs)

    def step(s, term):
        """s [batch, heads, dk, dv]; one chunk's terms -> (next s, out [batch, heads, chunk, dv] or None)."""
        v_new = term["u"] - term["w"] @ s
        out = term["q"] @ s + term["qk"] @ v_new if outputs else None
        s = term["carry"][..., None, None] * s + jnp.swapaxes(term["k"], -1, -2) @ v_new
        return s, out

    state, out = lax.scan(jax.checkpoint(step), state.astype(jnp.float32), terms)
    if not outputs:
        return None, state
    out = jnp.moveaxis(out, 0, 2)  # [batch, heads, chunks, chunk, dv]
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :length]
    return jnp.swapaxes(out, 1, 2), state


def _chunk_terms(q, k, v, g, beta, seg, start_seg, chunk: int, outputs: bool) -> dict:
    """The per-chunk terms of the scan, chunks first: u, w [chunks, batch, heads, chunk, dv | dk] (the WY values and
    weights), q [.., chunk, dk] (queries decayed from the chunk's start), qk [.., chunk, chunk] (causal decayed
    scores within the chunk; only with `outputs`), k [.., chunk, dk] (keys decayed to the chunk's end), carry
    [chunks, batch, heads] (the incoming state's decay over the chunk)."""
    f32 = lambda x: x.astype(jnp.float32)

    def by_chunk(x):  # [batch, length, heads, ...] -> [batch, heads, chunks, chunk, ...]
        x = f32(x).reshape(x.shape[0], -1, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = (None if x is None else by_chunk(x) for x in (q, k, v, g, beta))
    previous = jnp.concatenate([start_seg[:, None], seg[:, :-1]], axis=1)
    run = jnp.cumsum(seg != previous, axis=1).reshape(seg.shape[0], 1, -1, chunk)  # [batch, 1, chunks, chunk]
    before = jnp.concatenate([jnp.zeros_like(run[:, :, :1, -1]), run[:, :, :-1, -1]], axis=2)  # run before each chunk
    live = run == before[..., None]  # no document starts from the chunk's start to here
    last = run == run[..., -1:]  # in the document of the chunk's last token
    same = run[..., :, None] == run[..., None, :]  # [batch, 1, chunks, chunk, chunk]

    cum = jnp.cumsum(g, axis=-1)  # [batch, heads, chunks, chunk]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    pair = jnp.exp(jnp.where(causal & same, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # decay j -> i
    from_start = jnp.where(live, jnp.exp(cum), 0.0)
    to_end = jnp.where(last, jnp.exp(cum[..., -1:] - cum), 0.0)

    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    kk = jnp.where(strict, (beta[..., None] * k) @ jnp.swapaxes(k, -1, -2) * pair, 0.0)
    eye = jnp.eye(chunk, dtype=jnp.float32)
    rhs = jnp.concatenate([beta[..., None] * k * from_start[..., None], beta[..., None] * v], axis=-1)
    wu = jax.scipy.linalg.solve_triangular(eye + kk, rhs, lower=True, unit_diagonal=True)
    dk = k.shape[-1]
    terms = dict(
        w=wu[..., :dk],
        u=wu[..., dk:],
        k=k * to_end[..., None],
        carry=jnp.where(live[..., -1], jnp.exp(cum[..., -1]), 0.0),
    )
    if outputs:
        terms["q"], terms["qk"] = q * from_start[..., None], q @ jnp.swapaxes(k, -1, -2) * pair
    return {name: jnp.moveaxis(x, 2, 0) for name, x in terms.items()}


def affine_map(k, v, g, beta, seg, *, start_seg, chunk: int = CHUNK):
    """The map of a piece of the row on the state of the document that continues past its start: k [batch, length,
    heads, dk], v [batch, length, heads, dv], g / beta [batch, length, heads], seg [batch, length], start_seg [batch]
    (as `chunked`) -> [M | E] [batch, heads, dk, dk + dv] float32 with S_out = M S_in + E (M = 0 when a document
    starts in the piece; E the state reached from zero): one pass on values [0 | v] from [I | 0]."""
    batch, _, heads, dk = k.shape
    values = jnp.concatenate([jnp.zeros((*v.shape[:3], dk), v.dtype), v], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (batch, heads, dk, dk))
    start = jnp.concatenate([eye, jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32)], axis=-1)
    return chunked(None, k, values, g, beta, seg, state=start, start_seg=start_seg, chunk=chunk, outputs=False)[1]
