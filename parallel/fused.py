"""Fused attention on GPU: cuDNN flash attention through `jax.nn.dot_product_attention`, used where it has the
same semantics as the blockwise kernel — whole sequence in original order, no segment ids, equal q/k and v head
dims, 16-bit inputs. Everything else runs the blockwise kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


def usable(q, k, v, *, segment_ids, contiguous: bool, enabled: bool) -> bool:
    """Whether `attention` may replace the blockwise kernel for these inputs on the current backend."""
    return (
        enabled
        and jax.default_backend() == "gpu"
        and contiguous
        and segment_ids is None
        and q.dtype in SUPPORTED_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and k.shape[-1] == v.shape[-1]
        and q.shape[-1] <= 256
        and q.shape[1] == k.shape[1]
    )


def attention(q, k, v, *, causal: bool, scale: float, implementation: str = "cudnn"):
    """q: [batch, length, heads, d], k/v: [batch, length, kv_heads, d] -> [batch, length, heads, d]."""
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation=implementation)
