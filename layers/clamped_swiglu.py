"""GPT-OSS's experts (Hugging Face `GptOssExperts`): a clamped SwiGLU with biases, gate and up interleaved in one
matrix (column 2j is gate j, column 2j + 1 up j, as Hugging Face's gate_up_proj stores them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import parallel


def clamped_swiglu(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gate_up [..., 2 * mlp] interleaved -> [..., mlp]: gate clamped to at most `limit`, up to [-limit, limit],
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate_up[..., ::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)


def expert_clamped_swiglu(
    x: jax.Array,
    gate_up: jax.Array,
    gate_up_bias: jax.Array,
    down: jax.Array,
    down_bias: jax.Array,
    group_sizes=None,
    *,
    alpha: float,
    limit: float,
) -> jax.Array:
    """Clamped SwiGLU experts, gate_up [experts, embed, 2 * mlp], gate_up_bias [experts, 2 * mlp], down [experts,
    mlp, embed], down_bias [experts, embed]. Batched: x [experts, rows, embed] -> [experts, rows, embed]; grouped: x
    [rows, embed] sorted by expert with group_sizes [experts] rows each -> [rows, embed] (rows past the groups are
    padding, given the last expert's biases)."""
    if group_sizes is None:
        hidden = clamped_swiglu(jnp.einsum("erd,edf->erf", x, gate_up) + gate_up_bias[:, None], alpha, limit)
        return jnp.einsum("erf,efd->erd", hidden, down) + down_bias[:, None]
    expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=x.shape[0])
    hidden = clamped_swiglu(parallel.ragged_dot(x, gate_up, group_sizes) + gate_up_bias[expert], alpha, limit)
    return parallel.ragged_dot(hidden, down, group_sizes) + down_bias[expert]
