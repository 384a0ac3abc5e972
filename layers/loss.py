"""Next-token cross-entropy, chunked along the sequence so [length, vocab] logits never exist at once.

Both functions return (loss_sum, weight_sum) as float32 scalars, the mean loss being their ratio;
sums let data-parallel and gradient-accumulation steps combine exactly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from parallel.kernels.blockwise import even_chunk


def logits(hidden: jax.Array, kernel: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """hidden: [..., embed], kernel: [embed, vocab] -> float32 [..., vocab], multiplied in `dtype`.

    Inputs are cast to `dtype`; the product is accumulated and returned in float32.
    """
    return jnp.einsum(
        "...e,ev->...v",
        hidden.astype(dtype),
        kernel.astype(dtype),
        preferred_element_type=jnp.float32,
    )


def cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    *,
    dtype: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """Unchunked reference: hidden [batch, length, embed], kernel [embed, vocab], targets [batch, length], mask
    [batch, length] or [batch, length, groups] (several weightings of the same token losses in one pass).

    Returns (sum of mask * (logsumexp(logits) - logits[target]), sum of mask) over batch and length: scalars, or
    [groups]. `mask` is bool or float weights; targets outside [0, vocab) are clipped, so padding must be masked.
    """
    all_logits = logits(hidden, kernel, dtype)
    target_logits = jnp.take_along_axis(all_logits, targets[..., None], axis=-1, mode="clip")[..., 0]
    weights = mask.astype(jnp.float32)
    token_losses = jax.nn.logsumexp(all_logits, axis=-1) - target_logits
    token_losses = token_losses.reshape(*token_losses.shape, *(1,) * (weights.ndim - 2))
    return jnp.sum(weights * token_losses, axis=(0, 1)), jnp.sum(weights, axis=(0, 1))


def chunked_cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    *,
    chunk_size: int,
    dtype: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy` over length chunks: hidden [batch, length, embed], kernel [embed, vocab].

    targets: [batch, length], mask: [batch, length] or [batch, length, groups]. The length is scanned in chunks
    of at most `chunk_size` tokens (the largest divisor of the length that fits: one chunk when chunk_size >=
    length); each chunk is rematerialised in the backward pass, so at most [batch, chunk, vocab] logits are live.
    Returns float32 (loss_sum, weight_sum): scalars, or [groups].
    """
    batch, length = hidden.shape[:2]
    if chunk_size <= 0:
        raise ValueError(f"loss chunk_size must be positive, got {chunk_size}")
    chunk = even_chunk(length, chunk_size)
    num_chunks = length // chunk

    def to_chunks(x: jax.Array) -> jax.Array:
        """[batch, length, ...] -> [num_chunks, batch, chunk, ...]."""
        return jnp.swapaxes(x.reshape(batch, num_chunks, chunk, *x.shape[2:]), 0, 1)

    @functools.partial(jax.checkpoint, prevent_cse=False)  # scan already keeps steps apart
    def chunk_sums(hidden_chunk, targets_chunk, mask_chunk):
        return cross_entropy(hidden_chunk, kernel, targets_chunk, mask_chunk, dtype=dtype)

    def step(carry, inputs):
        loss_sum, weight_sum = chunk_sums(*inputs)
        return (carry[0] + loss_sum, carry[1] + weight_sum), None

    zero = jnp.zeros_like(mask[0, 0], jnp.float32)  # [groups] or a scalar, varying like the tokens per device
    (loss_sum, weight_sum), _ = jax.lax.scan(
        step, (zero, zero), (to_chunks(hidden), to_chunks(targets), to_chunks(mask))
    )
    return loss_sum, weight_sum
