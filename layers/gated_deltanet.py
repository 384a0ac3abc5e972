"""Gated DeltaNet, the linear-attention layer of Qwen3.5 and Qwen3-Next (Hugging Face's `*GatedDeltaNet`).

x -> q, k, v (a depthwise causal convolution over the sequence, then SiLU), z, b, a per head; q and k L2-normalised
(q scaled by key_dim ** -0.5) and repeated from the key heads to the value heads; beta = sigmoid(b), the log decay
g = -exp(a_log) * softplus(a + dt_bias); the gated delta rule (`parallel.gated_delta`) per value head; the output
RMS-normalised per head, scaled by `norm_scale` and gated by SiLU(z), then projected back. The convolution and the
rule run over the whole (possibly split) sequence through `parallel`, with the state reset at every document start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import parallel
from layers.params import logical_param, normal_param

L2_EPS = 1e-6  # inside the square root of q's and k's L2 norms (Hugging Face's l2norm)


class GatedDeltaNet(nnx.Module):
    """x [batch, length, embed] -> [batch, length, embed].

    Parameters: q / k [embed, key_heads, key_dim], v / z [embed, heads, value_dim], b / a [embed, heads];
    conv_q / conv_k [taps, key_heads, key_dim], conv_v [taps, heads, value_dim] (tap taps - 1 is the token itself);
    a_log [heads] (log of the decay rate, log U(0.01, 16) at first), dt_bias [heads] (ones); norm_scale [value_dim]
    (ones); out [heads, value_dim, embed]. heads must be a multiple of key_heads."""

    def __init__(
        self,
        embed_dim: int,
        *,
        key_heads: int,
        heads: int,
        key_dim: int,
        value_dim: int,
        taps: int = 4,
        norm_eps: float = 1e-6,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if heads % key_heads:
            raise ValueError(f"Gated DeltaNet value heads {heads} must be a multiple of its key heads {key_heads}")
        self.key_heads, self.heads, self.key_dim = key_heads, heads, key_dim
        self.norm_eps, self.dtype = norm_eps, dtype

        def projection(*shape, axes):
            return normal_param(rngs, (embed_dim, *shape), embed_dim, ("embed", *axes), param_dtype)

        keys, values = ("kv_heads", "head_dim"), ("heads", "head_dim")
        self.q, self.k = projection(key_heads, key_dim, axes=keys), projection(key_heads, key_dim, axes=keys)
        self.v, self.z = projection(heads, value_dim, axes=values), projection(heads, value_dim, axes=values)
        self.b, self.a = projection(heads, axes=("heads",)), projection(heads, axes=("heads",))
        conv = lambda *shape, axes: normal_param(rngs, (taps, *shape), taps, ("taps", *axes), param_dtype)
        self.conv_q, self.conv_k = conv(key_heads, key_dim, axes=keys), conv(key_heads, key_dim, axes=keys)
        self.conv_v = conv(heads, value_dim, axes=values)
        rates = jax.random.uniform(rngs.params(), (heads,), jnp.float32, 0.01, 16.0)
        self.a_log = logical_param(jnp.log(rates).astype(param_dtype), ("heads",))
        self.dt_bias = logical_param(jnp.ones((heads,), param_dtype), ("heads",))
        self.norm_scale = logical_param(jnp.ones((value_dim,), param_dtype), ("norm",))
        self.out = normal_param(
            rngs, (heads, value_dim, embed_dim), heads * value_dim, ("heads", "head_dim", "embed"), param_dtype
        )

    def __call__(self, x, positions, segment_ids=None):
        """x: [batch, length, embed] (the residual stream's layout), positions (unused: the recurrence is its own
        position) / segment_ids: [batch, length] -> [batch, length, embed] in x's layout."""
        del positions
        tokens = parallel.gather(x.astype(self.dtype))
        project = lambda kernel, equation="bte,ehd->bthd": tokens.project(equation, kernel[...].astype(self.dtype), "h")
        qkv = (project(self.q), project(self.k), project(self.v))
        qkv = (checkpoint_name(y, name) for y, name in zip(qkv, ("q_proj", "k_proj", "v_proj"), strict=True))
        convs = tuple(w[...].astype(self.dtype) for w in (self.conv_q, self.conv_k, self.conv_v))
        q, k, v = (jax.nn.silu(y) for y in parallel.causal_conv(tuple(qkv), convs, segment_ids))
        group = self.heads // self.key_heads
        q = jnp.repeat(_l2_normalise(q) * self.key_dim**-0.5, group, axis=2)
        k = jnp.repeat(_l2_normalise(k), group, axis=2)
        beta = jax.nn.sigmoid(project(self.b, "bte,eh->bth").astype(jnp.float32))
        a = project(self.a, "bte,eh->bth").astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.a_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
        core = parallel.gated_delta(q, k, v, g, beta, segment_ids)
        gated = self._gated_norm(core, project(self.z))
        return checkpoint_name(
            parallel.project_scatter("bthd,hde->bte", gated, self.out[...].astype(self.dtype), "h"), "o_proj"
        )

    def _gated_norm(self, core, z):
        """core, z: [batch, length, heads, value_dim] -> RMSNorm(core) * norm_scale * SiLU(z) in `dtype` (float32
        statistics and gate, as Hugging Face's RMSNormGated)."""
        core32 = core.astype(jnp.float32)
        normalised = core32 * jax.lax.rsqrt(jnp.mean(jnp.square(core32), axis=-1, keepdims=True) + self.norm_eps)
        scaled = self.norm_scale[...].astype(self.dtype) * normalised.astype(self.dtype)
        return (scaled.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(self.dtype)


def _l2_normalise(x):
    """x [..., d] / sqrt(sum x^2 + L2_EPS), the statistics in float32, in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True) + L2_EPS)).astype(x.dtype)
