"""Grouped-query self-attention with rotary embeddings; the attention itself is `parallel.attention`, the
projections gather tokens (`parallel.gather`) and reduce-scatter them (`parallel.project_scatter`).

Optional, as Hugging Face families have them: q/k/v biases (Qwen2's q/k/v_proj bias), an output bias (GPT-OSS's
o_proj bias), a per-head RMSNorm of queries and keys over head_dim before rope (Qwen3's q_norm / k_norm), a sliding
window (Mistral's sliding_window), a softmax scale other than head_dim ** -0.5 (Gemma's query_pre_attn_scalar ** -0.5),
learned attention sinks, one logit per head that joins every softmax as a key of value zero (GPT-OSS's sinks), rotary
embeddings of only the first features of each head (Qwen3.5's partial_rotary_factor) and an output gate, the output
times sigmoid of a second query-sized projection (Qwen3.5's q_proj, whose rows hold query and gate per head)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import parallel
from layers.norm import RMSNorm
from layers.params import logical_param, normal_param
from layers.rope import apply_rope, inverse_frequencies


class HeadBias(nnx.Module):
    """A bias of each head's features, `bias` [heads, head_dim] (zeros at first; named `bias`, so it gets no weight
    decay), added to a projection's output."""

    def __init__(self, num_heads: int, head_dim: int, axes: tuple[str, str], param_dtype=jnp.float32):
        self.bias = logical_param(jnp.zeros((num_heads, head_dim), param_dtype), axes)

    def __call__(self, y):
        """y: [batch, length, heads', head_dim] -> y + bias; heads' a multiple of heads (key/value heads repeated
        for tensor ranks: each bias row repeated alike)."""
        bias = self.bias[...].astype(y.dtype)
        return y + jnp.repeat(bias, y.shape[2] // bias.shape[0], axis=0)


class OutputBias(nnx.Module):
    """A bias `bias` [embed] of the output projection (zeros at first; named `bias`, so it gets no weight decay)."""

    def __init__(self, embed_dim: int, param_dtype=jnp.float32):
        self.bias = logical_param(jnp.zeros((embed_dim,), param_dtype), ("embed",))

    def __call__(self, y):
        """y: [batch, length, embed] -> y + bias."""
        return y + self.bias[...].astype(y.dtype)


class Attention(nnx.Module):
    """GQA/MQA attention: x [batch, length, embed] -> [batch, length, embed].

    Parameters: q [embed, heads, head_dim], k / v [embed, kv_heads, head_dim], o [heads, head_dim, embed]; with
    `qkv_bias` q_bias / k_bias / v_bias HeadBias of the heads / kv heads; with `qk_norm` q_norm / k_norm
    RMSNorm(head_dim, eps=norm_eps, offset=norm_offset); with `o_bias` o_bias OutputBias [embed]; with `sinks` sinks
    [heads] (zeros at first, no weight decay); with `output_gate` gate [embed, heads, head_dim]; `window` W: a query at
    i sees keys i - W < j <= i (None: all before it); `scale`: the softmax scale (None: head_dim ** -0.5);
    `rotary_dim`: rope rotates each head's first rotary_dim features (None: all of them)."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope_theta: float,
        rope_scaling=None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        o_bias: bool = False,
        sinks: bool = False,
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        window: int | None = None,
        scale: float | None = None,
        rotary_dim: int | None = None,
        output_gate: bool = False,
        param_dtype=jnp.float32,
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.window = dtype, window
        self.scale = head_dim**-0.5 if scale is None else scale
        inv_freq, self.rope_factor = inverse_frequencies(rotary_dim or head_dim, rope_theta, rope_scaling)
        self.inv_freq = tuple(float(f) for f in inv_freq)
        self.q = normal_param(
            rngs, (embed_dim, num_heads, head_dim), embed_dim, ("embed", "heads", "head_dim"), param_dtype
        )
        self.k = normal_param(
            rngs, (embed_dim, num_kv_heads, head_dim), embed_dim, ("embed", "kv_heads", "head_dim"), param_dtype
        )
        self.v = normal_param(
            rngs, (embed_dim, num_kv_heads, head_dim), embed_dim, ("embed", "kv_heads", "head_dim"), param_dtype
        )
        self.o = normal_param(
            rngs, (num_heads, head_dim, embed_dim), num_heads * head_dim, ("heads", "head_dim", "embed"), param_dtype
        )
        self.gate = (
            normal_param(rngs, (embed_dim, num_heads, head_dim), embed_dim, ("embed", "heads", "head_dim"), param_dtype)
            if output_gate
            else None
        )
        heads, kv_heads = ("heads", "head_dim"), ("kv_heads", "head_dim")
        self.q_bias = HeadBias(num_heads, head_dim, heads, param_dtype) if qkv_bias else None
        self.k_bias = HeadBias(num_kv_heads, head_dim, kv_heads, param_dtype) if qkv_bias else None
        self.v_bias = HeadBias(num_kv_heads, head_dim, kv_heads, param_dtype) if qkv_bias else None
        norms = dict(eps=norm_eps, offset=norm_offset, param_dtype=param_dtype, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(head_dim, **norms) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, **norms) if qk_norm else None
        self.o_bias = OutputBias(embed_dim, param_dtype) if o_bias else None
        self.sinks = logical_param(jnp.zeros((num_heads,), param_dtype), ("heads",)) if sinks else None

    def _project(self, tokens, kernel, bias: HeadBias | None, repeat: bool = False):
        """tokens.project onto [batch, length, heads, head_dim], plus `bias` when there is one."""
        y = tokens.project("bte,ehd->bthd", kernel[...].astype(self.dtype), "h", repeat=repeat)
        return y if bias is None else bias(y)

    def _rotate(self, x, positions):
        """Rope on the first 2 * len(inv_freq) features of each head of x [batch, length, heads, head_dim]."""
        rotary = 2 * len(self.inv_freq)
        turned = apply_rope(x[..., :rotary], positions, jnp.asarray(self.inv_freq, jnp.float32), self.rope_factor)
        return turned if rotary == x.shape[-1] else jnp.concatenate([turned, x[..., rotary:]], axis=-1)

    def __call__(self, x, positions, segment_ids=None):
        """x: [batch, length, embed] (the residual stream's layout, scattered over `tensor` under scattered tensor
        parallelism), positions/segment_ids: [batch, length] -> [batch, length, embed] in x's layout."""
        tokens = parallel.gather(x.astype(self.dtype))
        q = checkpoint_name(self._project(tokens, self.q, self.q_bias), "q_proj")
        k = checkpoint_name(self._project(tokens, self.k, self.k_bias, repeat=True), "k_proj")
        v = checkpoint_name(self._project(tokens, self.v, self.v_bias, repeat=True), "v_proj")
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (self._rotate(x, positions) for x in (q, k))
        sinks = None if self.sinks is None else self.sinks[...]
        out = parallel.attention(
            q, k, v, segment_ids=segment_ids, causal=True, scale=self.scale, window=self.window, sinks=sinks
        )
        if self.gate is not None:
            gate = tokens.project("bte,ehd->bthd", self.gate[...].astype(self.dtype), "h")
            out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)
        y = checkpoint_name(
            parallel.project_scatter("bthd,hde->bte", out, self.o[...].astype(self.dtype), "h"), "o_proj"
        )
        return y if self.o_bias is None else self.o_bias(y)
