"""A dense stand-in for FlashAttention-3's variable-length calls (parallel.kernels.flash3.Library), for CPU tests.

Same operands, keywords and results: q [T, h, d], k / v [Tk, hk, d] of one width, a multiple of 8; cu_seqlens
[n + 1] on each side; out [T, h, d] and lse [h, T] (natural log). Sequence i pairs queries cu_q[i]..cu_q[i + 1] with
keys cu_k[i]..cu_k[i + 1]; causal and window masks are aligned to each sequence's last key, as FlashAttention aligns
them. A query with no visible key gets zeros and lse -inf. Offsets that decrease or do not end at the side's length
poison every output with NaN, as would reading outside a sequence.
"""

import jax.numpy as jnp

from parallel.kernels import flash3


def _positions(cu, length: int):
    """[n + 1] offsets -> ([length] sequence of each token, [length] position within it, its sequence's length,
    bool: the offsets are well formed)."""
    token = jnp.arange(length)
    sequence = jnp.searchsorted(cu, token, side="right") - 1
    sequence = jnp.clip(sequence, 0, cu.shape[0] - 2)
    sizes = cu[1:] - cu[:-1]
    ok = jnp.all(sizes >= 0) & (cu[0] == 0) & (cu[-1] == length)
    return sequence, token - cu[sequence], sizes[sequence], ok


def _weights(q, k, cu_q, cu_k, lse, *, scale, causal, window):
    """(probabilities [h, T, Tk] under the mask, lse [h, T], bool: offsets well formed) of grouped heads."""
    if q.shape[-1] % 8 or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"widths: q {q.shape}, k {k.shape}")
    group = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k, precision="highest") * scale
    q_seq, q_pos, q_len, q_ok = _positions(cu_q, q.shape[0])
    k_seq, k_pos, _, k_ok = _positions(cu_k, k.shape[0])
    shift = (jnp.take(cu_k[1:] - cu_k[:-1], q_seq) - q_len)[:, None]  # each sequence's last query meets its last key
    mask = q_seq[:, None] == k_seq[None, :]
    if causal:
        mask &= k_pos[None, :] <= q_pos[:, None] + shift
    if window[0] >= 0:
        mask &= k_pos[None, :] >= q_pos[:, None] + shift - window[0]
    s = jnp.where(mask[None], s, -jnp.inf)
    if lse is None:
        top = jnp.max(s, -1, keepdims=True)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        lse = jnp.log(jnp.sum(jnp.exp(s - top), -1)) + top[..., 0]
    p = jnp.where(mask[None], jnp.exp(s - lse[..., None]), 0.0)
    return p, lse, q_ok & k_ok


def forward(q, k, v, cu_q, cu_k, *, lengths, scale, causal, window):
    p, lse, ok = _weights(q, k, cu_q, cu_k, None, scale=scale, causal=causal, window=window)
    group = q.shape[1] // k.shape[1]
    out = jnp.einsum("hqk,khd->qhd", p, jnp.repeat(v, group, axis=1).astype(jnp.float32), precision="highest")
    poison = jnp.where(ok, 0.0, jnp.nan)
    return (out + poison).astype(q.dtype), lse + poison


def backward(dout, q, k, v, out, lse, cu_q, cu_k, *, lengths, scale, causal, window):
    p, _, ok = _weights(q, k, cu_q, cu_k, lse, scale=scale, causal=causal, window=window)
    group = q.shape[1] // k.shape[1]
    f32 = lambda x: x.astype(jnp.float32)
    k_all, v_all = (jnp.repeat(f32(x), group, axis=1) for x in (k, v))
    dp = jnp.einsum("qhd,khd->hqk", f32(dout), v_all, precision="highest")
    delta = jnp.einsum("qhd,qhd->hq", f32(dout), f32(out), precision="highest")
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("hqk,khd->qhd", ds, k_all, precision="highest")
    per_head = lambda x: x.reshape(x.shape[0], k.shape[1], group, x.shape[-1]).sum(2)
    dk = per_head(jnp.einsum("hqk,qhd->khd", ds, f32(q), precision="highest"))
    dv = per_head(jnp.einsum("hqk,qhd->khd", p, f32(dout), precision="highest"))
    poison = jnp.where(ok, 0.0, jnp.nan)
    return tuple((x + poison).astype(q.dtype) for x in (dq, dk, dv))


STANDIN = flash3.Library(forward, backward)
