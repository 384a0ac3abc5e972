"""The fused (cuDNN) path: chosen only where its semantics equal the blockwise kernel's, and equal to it.

On CPU the same `jax.nn.dot_product_attention` call runs with implementation="xla"; the cuDNN kernel itself
needs a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel
from parallel import fused, kernels
from tests.parallel.attention_reference import relative_error


def qkv(dtype=jnp.bfloat16, dv=16):
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(2, 32, 4, 16)), dtype),
        jnp.asarray(rng.normal(size=(2, 32, 2, 16)), dtype),
        jnp.asarray(rng.normal(size=(2, 32, 2, dv)), dtype),
    )


def test_usable_only_where_semantics_match(monkeypatch):
    q, k, v = qkv()
    ok = dict(segment_ids=None, contiguous=True, enabled=True)
    assert not fused.usable(q, k, v, **ok)  # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert fused.usable(q, k, v, **ok)
    assert not fused.usable(q, k, v, **{**ok, "enabled": False})
    assert not fused.usable(q, k, v, **{**ok, "segment_ids": jnp.ones((2, 32), jnp.int32)})
    assert not fused.usable(q, k, v, **{**ok, "contiguous": False})
    assert not fused.usable(*qkv(jnp.float32), **ok)
    assert not fused.usable(*qkv(dv=8), **ok)  # MLA-style head dims


@pytest.mark.parametrize("causal", [True, False])
def test_fused_equals_blockwise(monkeypatch, causal):
    """Dispatched from parallel.attention (strategy none) with the xla implementation standing in for cuDNN."""
    q, k, v = qkv(jnp.float32)
    monkeypatch.setattr(fused, "usable", lambda *a, **kw: True)
    calls = []
    xla = functools.partial(fused.attention, implementation="xla")
    monkeypatch.setattr(fused, "attention", lambda *a, **kw: calls.append(1) or xla(*a, **kw))
    out = parallel.attention(q, k, v, causal=causal, scale=0.3)
    expected, _ = kernels.attention(q, k, v, kernel="blockwise", causal=causal, scale=0.3)
    assert calls and relative_error(out, expected) < 2e-5
