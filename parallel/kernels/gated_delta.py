"""The gated delta rule (Gated DeltaNet's recurrence) in chunks: per head, a state S [dk, dv] that each token t updates

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t,

and that a document start resets (S_{t-1} := 0 where the segment id changes), so packed rows never leak state.

Chunks of `chunk` tokens: inside a chunk every token-to-token term is a matmul (the WY form: the inverse of one unit
lower triangular matrix gives w and u, with u - w S the chunk's corrected values), and one scan over the chunks
carries S. A reset is
the limit g_t -> -inf, written as masks (decay factors of token pairs in different documents are 0; the chunk's
incoming state reaches only tokens of the document it belongs to), so nothing computes -inf - -inf. Everything runs
in float32 (float64 when given float64, to check the float32 results against). Memory is O(length) with a small
constant: chunks go in groups of GROUP, each group's terms computed at once ([chunk, chunk + d] per chunk and head)
and rematerialised in the backward, so autodiff keeps the inputs, the state each group starts from and one group's
terms at a time.

The recurrence is affine in the incoming state: running it on values [0 | v] from [I | 0] gives [M | E], the map
S_out = M S_in + E of a piece of the row (parallel/recurrent.py splits the row over devices with it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallel.kernels.blockwise import even_chunk

CHUNK = 64
GROUP = 16  # chunks whose terms are computed at once and rematerialised together in the backward


def chunked(q, k, v, g, beta, seg, *, state, start_seg, chunk: int = CHUNK, outputs: bool = True):
    """q, k: [batch, length, heads, dk] (q already scaled; None when not `outputs`), v: [batch, length, heads, dv],
    g (log decay, <= 0) and beta: [batch, length, heads], seg: [batch, length] int32 (a change of id starts a
    document); state: [batch, heads, dk, dv], the state before the first token, belonging to the document of id
    start_seg [batch] (an id no token has: no state carries in) -> (out [batch, length, heads, dv], or None when not
    `outputs`; the state after the last token [batch, heads, dk, dv]), both in `compute_dtype(k, v)`."""
    length = k.shape[1]
    pad = -length % chunk
    if pad:  # identity tokens (no decay, no write) of the last document
        widths = lambda x: [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        q, k, v, g, beta = (None if x is None else jnp.pad(x, widths(x)) for x in (q, k, v, g, beta))
        seg = jnp.pad(seg, [(0, 0), (0, pad)], mode="edge")
    dtype = compute_dtype(k, v)
    values, runs = _by_chunk(q, k, v, g, beta, seg, start_seg, chunk)
    state, out = _scan(outputs, dtype, values, runs, state.astype(dtype))
    if not outputs:
        return None, state
    out = jnp.moveaxis(out, 0, 2)  # [batch, heads, chunks, chunk, dv]
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :length]
    return jnp.swapaxes(out, 1, 2), state


def compute_dtype(*arrays) -> jnp.dtype:
    """What the rule computes in: float32, or float64 when an input is float64."""
    return jnp.result_type(jnp.float32, *(x.dtype for x in arrays))


def _by_chunk(q, k, v, g, beta, seg, start_seg, chunk: int) -> tuple[dict, dict]:
    """The row cut into chunks, chunks first: ({q, k, v: [chunks, batch, heads, chunk, d], g, beta: [chunks, batch,
    heads, chunk]} in the inputs' dtypes (q left out when None), {run: [chunks, batch, 1, chunk] the document run of
    each token (the count of document starts up to it), before: [chunks, batch, 1] the run of the token before the
    chunk})."""

    def cut(x):  # [batch, length, heads, ...] -> [chunks, batch, heads, chunk, ...]
        x = x.reshape(x.shape[0], -1, chunk, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 1), 2, 0)

    values = {name: cut(x) for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items() if x is not None}
    previous = jnp.concatenate([start_seg[:, None], seg[:, :-1]], axis=1)
    run = jnp.cumsum(seg != previous, axis=1).reshape(seg.shape[0], -1, chunk)
    run = jnp.moveaxis(run, 1, 0)[:, :, None, :]  # [chunks, batch, 1, chunk]
    before = jnp.concatenate([jnp.zeros_like(run[:1, ..., -1]), run[:-1, ..., -1]], axis=0)
    return values, dict(run=run, before=before)


def _step(s, term: dict, outputs: bool):
    """s [batch, heads, dk, dv]; one chunk's terms -> (next s, out [batch, heads, chunk, dv], or a 0 without
    `outputs`)."""
    v_new = term["u"] - term["w"] @ s
    out = term["q"] @ s + term["qk"] @ v_new if outputs else jnp.zeros((), s.dtype)
    s = term["carry"][..., None, None] * s + jnp.swapaxes(term["k"], -1, -2) @ v_new
    return s, out


def _scan(outputs: bool, dtype: jnp.dtype, values: dict, runs: dict, state):
    """One scan over groups of GROUP chunks (or the largest group size dividing the chunks), each group's terms
    computed at once and its chunks scanned, carrying the state -> (final state, outputs per chunk [chunks, batch,
    heads, chunk, dv] or [chunks] zeros). A group is rematerialised in the backward: autodiff keeps the state each
    group starts from, and one group's terms at a time."""
    chunks = runs["run"].shape[0]
    size = even_chunk(chunks, GROUP)
    grouped = lambda x: x.reshape(chunks // size, size, *x.shape[1:])

    def group(s, inputs):
        terms = _terms(*inputs, outputs, dtype)
        return lax.scan(lambda s, term: _step(s, term, outputs), s, terms)

    final, out = lax.scan(jax.checkpoint(group), state, jax.tree.map(grouped, (values, runs)))
    return final, out.reshape(chunks, *out.shape[2:])


def _terms(values: dict, runs: dict, outputs: bool, dtype: jnp.dtype) -> dict:
    """The per-chunk terms of the scan, chunks first, from `_by_chunk`'s arrays: u, w [chunks, batch, heads, chunk,
    dv | dk] (the WY values and weights), q [.., chunk, dk] (queries decayed from the chunk's start), qk [.., chunk,
    chunk] (causal decayed scores within the chunk; only with `outputs`), k [.., chunk, dk] (keys decayed to the
    chunk's end), carry [chunks, batch, heads] (the incoming state's decay over the chunk)."""
    q, k, v, g, beta = (values[name].astype(dtype) if name in values else None for name in ("q", "k", "v", "g", "beta"))
    run, before = runs["run"], runs["before"]
    chunk = run.shape[-1]
    live = run == before[..., None]  # no document starts from the chunk's start to here
    last = run == run[..., -1:]  # in the document of the chunk's last token
    same = run[..., :, None] == run[..., None, :]  # [chunks, batch, 1, chunk, chunk]

    cum = jnp.cumsum(g, axis=-1)  # [chunks, batch, heads, chunk]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    pair = jnp.exp(jnp.where(causal & same, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # decay j -> i
    from_start = jnp.where(live, jnp.exp(cum), 0.0)
    to_end = jnp.where(last, jnp.exp(cum[..., -1:] - cum), 0.0)

    strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    kk = jnp.where(strict, (beta[..., None] * k) @ jnp.swapaxes(k, -1, -2) * pair, 0.0)
    rhs = jnp.concatenate([beta[..., None] * k * from_start[..., None], beta[..., None] * v], axis=-1)
    wu = unit_lower_inverse(kk) @ rhs
    dk = k.shape[-1]
    terms = dict(
        w=wu[..., :dk],
        u=wu[..., dk:],
        k=k * to_end[..., None],
        carry=jnp.where(live[..., -1], jnp.exp(cum[..., -1]), 0.0),
    )
    if outputs:
        terms["q"], terms["qk"] = q * from_start[..., None], q @ jnp.swapaxes(k, -1, -2) * pair
    return terms


def unit_lower_inverse(strict):
    """strict: [..., n, n] strictly lower triangular -> (I + strict)^-1 [..., n, n], by doubling diagonal blocks: the
    inverse of [[A, 0], [C, B]] is [[A^-1, 0], [-B^-1 C A^-1, B^-1]], every block pair of a size at once, log2(n)
    levels of batched matmuls (n padded to a power of two). Not a triangular solve: XLA:CPU's runs its batch on the
    thread pool the devices' own threads are blocked on, a deadlock with several devices."""
    n, batch = strict.shape[-1], strict.shape[:-2]
    size = 1 << (n - 1).bit_length()
    strict = jnp.pad(strict, [(0, 0)] * len(batch) + [(0, size - n)] * 2)
    inverse = jnp.ones((*batch, size, 1, 1), strict.dtype)  # the inverses of the 1 x 1 diagonal blocks
    width = 1
    while width < size:
        pairs = size // (2 * width)
        halves = inverse.reshape(*batch, pairs, 2, width, width)
        upper, lower = halves[..., 0, :, :], halves[..., 1, :, :]
        blocks = jnp.swapaxes(strict.reshape(*batch, pairs, 2 * width, pairs, 2 * width), -3, -2)
        diagonal = blocks.reshape(*batch, pairs * pairs, 2 * width, 2 * width)[..., :: pairs + 1, :, :]
        corner = -lower @ diagonal[..., width:, :width] @ upper
        top = jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([corner, lower], axis=-1)], axis=-2)
        width *= 2
    return inverse.reshape(*batch, size, size)[..., :n, :n]


def affine_map(k, v, g, beta, seg, *, start_seg, chunk: int = CHUNK):
    """The map of a piece of the row on the state of the document that continues past its start: k [batch, length,
    heads, dk], v [batch, length, heads, dv], g / beta [batch, length, heads], seg [batch, length], start_seg [batch]
    (as `chunked`) -> [M | E] [batch, heads, dk, dk + dv] in `compute_dtype(k, v)` with S_out = M S_in + E (M = 0
    when a document starts in the piece; E the state reached from zero): one pass on values [0 | v] from [I | 0]."""
    batch, _, heads, dk = k.shape
    values = jnp.concatenate([jnp.zeros((*v.shape[:3], dk), v.dtype), v], axis=-1)
    dtype = compute_dtype(k, v)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=dtype), (batch, heads, dk, dk))
    start = jnp.concatenate([eye, jnp.zeros((batch, heads, dk, v.shape[-1]), dtype)], axis=-1)
    return chunked(None, k, values, g, beta, seg, state=start, start_seg=start_seg, chunk=chunk, outputs=False)[1]
