"""Rotary embeddings against direct NumPy derivations of the Hugging Face formulas."""

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers.rope import apply_rope, inverse_frequencies, yarn_softmax_scale
from train.config import RopeScalingConfig


def reference_plain(dim, theta):
    return [1.0 / theta ** (2 * i / dim) for i in range(dim // 2)]


def reference_llama3(dim, theta, factor, low_freq_factor, high_freq_factor, original):
    out = []
    for freq in reference_plain(dim, theta):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high_freq_factor:
            out.append(freq)
        elif wavelen > original / low_freq_factor:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def reference_yarn(dim, theta, factor, original, beta_fast, beta_slow, truncate=True):
    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    width = (high - low) if high != low else 0.001
    out = []
    for i, freq in enumerate(reference_plain(dim, theta)):
        ramp = min(max((i - low) / width, 0.0), 1.0)  # 0: extrapolate (keep), 1: interpolate
        out.append(freq * (1 - ramp) + freq / factor * ramp)
    return out


def test_plain_frequencies():
    inv_freq, attention_factor = inverse_frequencies(64, 10000.0)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (32,)
    np.testing.assert_allclose(inv_freq, reference_plain(64, 10000.0), rtol=1e-6)
    assert attention_factor == 1.0
    same, _ = inverse_frequencies(64, 10000.0, RopeScalingConfig(type="none", factor=8.0))
    np.testing.assert_array_equal(same, inv_freq)


def test_llama3_frequencies():
    scaling = RopeScalingConfig(
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    inv_freq, attention_factor = inverse_frequencies(128, 500000.0, scaling)
    expected = reference_llama3(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-6)
    assert attention_factor == 1.0
    ratio = np.asarray(expected) / np.asarray(reference_plain(128, 500000.0))
    assert np.any(ratio == 1.0) and np.any(ratio == 1 / 8) and np.any((ratio > 1 / 8) & (ratio < 1))


@pytest.mark.parametrize(
    "dim,theta,factor,original,truncate",
    [(64, 10000.0, 40.0, 4096, True), (128, 1e6, 4.0, 32768, True), (64, 150000.0, 32.0, 4096, False)],
)
def test_yarn_frequencies(dim, theta, factor, original, truncate):
    scaling = SimpleNamespace(
        type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
        truncate=truncate,
    )
    inv_freq, _ = inverse_frequencies(dim, theta, scaling)
    expected = reference_yarn(dim, theta, factor, original, 32.0, 1.0, truncate)
    np.testing.assert_allclose(inv_freq, expected, rtol=1e-6)
    ratio = np.asarray(expected) / np.asarray(reference_plain(dim, theta))
    assert np.isclose(ratio[0], 1.0) and np.isclose(ratio[-1], 1 / factor)
    assert np.any((ratio > 1 / factor + 1e-6) & (ratio < 1 - 1e-6))


@pytest.mark.parametrize(
    "factor,mscale,mscale_all_dim,expected",
    [
        (40.0, 1.0, 0.0, 0.1 * math.log(40.0) + 1.0),
        (40.0, 0.0, 1.0, 0.1 * math.log(40.0) + 1.0),
        (40.0, 1.0, 1.0, 1.0),
        (40.0, 0.707, 1.0, (0.0707 * math.log(40.0) + 1.0) / (0.1 * math.log(40.0) + 1.0)),
        (1.0, 1.0, 0.0, 1.0),
    ],
)
def test_yarn_attention_factor(factor, mscale, mscale_all_dim, expected):
    scaling = RopeScalingConfig(type="yarn", factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim)
    _, attention_factor = inverse_frequencies(64, 10000.0, scaling)
    assert attention_factor == pytest.approx(expected, rel=1e-12)


def test_yarn_softmax_scale():
    deepseek = RopeScalingConfig(type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    assert yarn_softmax_scale(deepseek) == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2)
    assert yarn_softmax_scale(RopeScalingConfig(type="yarn", factor=40.0, mscale_all_dim=0.0)) == 1.0
    assert yarn_softmax_scale(RopeScalingConfig(type="llama3", factor=8.0, mscale_all_dim=1.0)) == 1.0
    assert yarn_softmax_scale(None) == 1.0


def test_invalid_arguments():
    with pytest.raises(ValueError, match="ntk"):
        inverse_frequencies(64, 10000.0, RopeScalingConfig(type="ntk"))
    with pytest.raises(ValueError, match="even"):
        inverse_frequencies(7, 10000.0)


def reference_rope(x, positions, inv_freq, attention_factor, interleaved):
    """Rotates each pair with explicit cos / sin; output pair i lands at (i, i + dim // 2)."""
    half = x.shape[-1] // 2
    out = np.zeros_like(x, dtype=np.float64)
    for i in range(half):
        angle = (positions.astype(np.float32) * np.float32(inv_freq[i])).astype(np.float64)[:, :, None]
        cos, sin = np.cos(angle) * attention_factor, np.sin(angle) * attention_factor
        a, b = (x[..., 2 * i], x[..., 2 * i + 1]) if interleaved else (x[..., i], x[..., i + half])
        out[..., i] = a * cos - b * sin
        out[..., i + half] = b * cos + a * sin
    return out


def hf_interleave_reference(x, positions, inv_freq, attention_factor):
    """NumPy transcription of Hugging Face `apply_rotary_pos_emb_interleave` (heads last but one)."""
    b, s, h, d = x.shape
    x = x.reshape(b, s, h, d // 2, 2).swapaxes(-1, -2).reshape(b, s, h, d)
    freqs = positions.astype(np.float32)[..., None] * inv_freq
    emb = np.concatenate([freqs, freqs], axis=-1)[:, :, None, :].astype(np.float64)
    cos, sin = np.cos(emb) * attention_factor, np.sin(emb) * attention_factor
    rotated_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated_half * sin


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("attention_factor", [1.0, 1.3])
def test_apply_rope_matches_numpy(interleaved, attention_factor):
    x = np.asarray(jax.random.normal(jax.random.key(0), (2, 5, 3, 16)))
    positions = np.array([[0, 1, 2, 3, 4], [7, 100, 31, 2, 9]])
    inv_freq, _ = inverse_frequencies(16, 10000.0)
    y = apply_rope(jnp.asarray(x), jnp.asarray(positions), inv_freq, attention_factor, interleaved=interleaved)
    assert y.shape == x.shape and y.dtype == jnp.float32
    expected = reference_rope(x, positions, inv_freq, attention_factor, interleaved)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
    if interleaved:
        hf = hf_interleave_reference(x, positions, inv_freq, attention_factor)
        np.testing.assert_allclose(np.asarray(y), hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_preserves_norm(interleaved):
    x = jax.random.normal(jax.random.key(1), (1, 6, 2, 32))
    positions = jnp.array([[0, 3, 17, 250, 4096, 65535]])
    inv_freq, _ = inverse_frequencies(32, 10000.0)
    y = apply_rope(x, positions, inv_freq, interleaved=interleaved)
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(y), axis=-1), np.linalg.norm(np.asarray(x), axis=-1), rtol=1e-5
    )


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_depend_only_on_relative_position(interleaved):
    q = jax.random.normal(jax.random.key(2), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(3), (1, 1, 1, 16))
    inv_freq, _ = inverse_frequencies(16, 10000.0)
    query_positions = jnp.array([[5, 12, 40, 77]])

    def scores(offset):
        rq = apply_rope(jnp.broadcast_to(q, (1, 4, 1, 16)), query_positions, inv_freq, interleaved=interleaved)
        rk = apply_rope(jnp.broadcast_to(k, (1, 4, 1, 16)), query_positions - offset, inv_freq, interleaved=interleaved)
        return np.asarray(jnp.sum(rq * rk, axis=-1)).ravel()

    for offset in (0, 3):
        s = scores(offset)
        np.testing.assert_allclose(s, np.full_like(s, s[0]), rtol=1e-4, atol=1e-5)
    assert not np.isclose(scores(0)[0], scores(3)[0], rtol=1e-3)


def test_apply_rope_keeps_dtype():
    x = jnp.ones((1, 2, 1, 8), jnp.bfloat16)
    inv_freq, _ = inverse_frequencies(8, 10000.0)
    assert apply_rope(x, jnp.array([[0, 1]]), inv_freq).dtype == jnp.bfloat16
