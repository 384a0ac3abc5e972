"""Rotary position embeddings with Hugging Face `transformers` semantics.

Frequencies follow `_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
`_compute_llama3_parameters` and `_compute_yarn_parameters` of `transformers.modeling_rope_utils`; they are derived
in float64 and returned as float32. Rotation angles are always computed in float32.

Differences from Hugging Face, by design: an explicit `attention_factor` override is not supported. Like Hugging
Face, yarn uses `scaling.factor` as given (Hugging Face falls back to max_position_embeddings /
original_max_position_embeddings only when factor is absent). A zero `mscale` stands for Hugging Face's absent one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

SCALINGS = ("none", "llama3", "yarn", "linear")


@dataclass(frozen=True)
class RopeScalingConfig:
    """Rotary-embedding context extension; `type` one of SCALINGS (fields as in Hugging Face)."""

    type: str = "none"  # none | llama3 | yarn | linear
    factor: float = 1.0  # how much longer than the original context; linear: positions divided by it (Gemma 3)
    original_max_position_embeddings: int = 8192  # the context the scaled rope was trained at
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original / high_freq_factor are kept
    beta_fast: float = 32.0  # yarn: rotations at which the correction range starts (kept above it)
    beta_slow: float = 1.0  # yarn: rotations at which it ends (interpolated below it)
    mscale: float = 1.0  # yarn: the attention temperature term's coefficient
    mscale_all_dim: float = 0.0  # yarn: its coefficient over all dimensions (DeepSeek); 0 = none
    truncate: bool = True  # yarn: round the correction range to whole dimensions (GPT-OSS: false)


def stretch_scaling(scaling: RopeScalingConfig, covered: int, context_length: int, kind: str) -> RopeScalingConfig:
    """A rope that covers `covered` positions with `scaling`, stretched to cover `context_length` (> covered): its
    factor grows by context_length / covered, the other fields kept; an unscaled rope (type none, trained at `covered`
    positions) becomes `kind` (llama3 or yarn, the type's defaults) with factor context_length / covered over
    original_max_position_embeddings = covered. For yarn (covering factor x original) and an unscaled rope that is
    factor = context_length / the original context, the factor YaRN and Llama 3.1 define."""
    if kind not in SCALINGS[1:]:
        raise ValueError(f"a rope is stretched with {', '.join(SCALINGS[1:])}, not {kind!r}")
    if scaling.type == "none":
        return RopeScalingConfig(type=kind, factor=context_length / covered, original_max_position_embeddings=covered)
    return replace(scaling, factor=scaling.factor * context_length / covered)


def _plain_inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """theta ** (-2i / head_dim) for i < head_dim // 2; float64 [head_dim // 2]."""
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _llama3(inv_freq: np.ndarray, scaling: RopeScalingConfig) -> np.ndarray:
    """Llama 3.1 band-wise scaling of inv_freq [head_dim // 2]."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(head_dim: int, theta: float, scaling: RopeScalingConfig) -> tuple[float, float]:
    """Dimension-pair indices (low, high) between which YaRN ramps from extrapolation to interpolation; whole
    numbers when `scaling.truncate`."""

    def correction_dim(num_rotations: float) -> float:
        wavelengths = scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def _yarn(head_dim: int, theta: float, scaling: RopeScalingConfig) -> tuple[np.ndarray, float]:
    """YaRN inv_freq [head_dim // 2] and the cos/sin attention factor."""
    if scaling.mscale and scaling.mscale_all_dim:
        attention_factor = yarn_get_mscale(scaling.factor, scaling.mscale) / yarn_get_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    else:
        attention_factor = yarn_get_mscale(scaling.factor)
    extrapolation = _plain_inverse_frequencies(head_dim, theta)
    interpolation = extrapolation / scaling.factor
    low, high = _yarn_correction_range(head_dim, theta, scaling)
    if low == high:
        high += 0.001  # avoids a zero-width ramp, as Hugging Face does
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    inv_freq = interpolation * (1.0 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScalingConfig | None = None
) -> tuple[np.ndarray, float]:
    """Rotary frequencies for `head_dim` rotated dims -> (inv_freq float32 [head_dim // 2], attention_factor).

    `scaling.type` is one of SCALINGS; `scaling` None means "none".
    """
    if head_dim % 2:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    kind = "none" if scaling is None else scaling.type
    if kind == "none":
        inv_freq, attention_factor = _plain_inverse_frequencies(head_dim, theta), 1.0
    elif kind == "llama3":
        inv_freq, attention_factor = _llama3(_plain_inverse_frequencies(head_dim, theta), scaling), 1.0
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn(head_dim, theta, scaling)
    elif kind == "linear":
        inv_freq, attention_factor = _plain_inverse_frequencies(head_dim, theta) / scaling.factor, 1.0
    else:
        raise ValueError(f"rope scaling type {kind!r} is not one of {', '.join(SCALINGS)}")
    return inv_freq.astype(np.float32), attention_factor


def yarn_softmax_scale(scaling: RopeScalingConfig | None) -> float:
    """Multiplier DeepSeek applies to the softmax scale: yarn_get_mscale(factor, mscale_all_dim) ** 2.

    1.0 unless `scaling.type` is "yarn" with a nonzero `mscale_all_dim`.
    """
    if scaling is None or scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_get_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array | np.ndarray,
    attention_factor: float = 1.0,
    *,
    interleaved: bool = False,
) -> jax.Array:
    """Rotates x: [batch, length, heads, dim] by positions: [batch, length] (int); inv_freq: [dim // 2].

    Pair i is rotated by angle positions * inv_freq[i] and scaled by `attention_factor`.
    interleaved=False (Llama): pair i is (x[i], x[i + dim // 2]); the output has the same layout.
    interleaved=True (DeepSeek checkpoints): pair i is (x[2i], x[2i + 1]); the output is in the
    half layout, out[i] and out[i + dim // 2] being the rotated pair i, exactly as Hugging Face's
    `apply_rotary_pos_emb_interleave` returns it. Queries and keys must use the same layout;
    their dot products do not depend on it. The rotation is done in float32; returns x.dtype.
    """
    half = x.shape[-1] // 2
    if x.shape[-1] != 2 * inv_freq.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} dims but inv_freq rotates {2 * inv_freq.shape[-1]}")
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos = (jnp.cos(angles) * attention_factor)[:, :, None, :]
    sin = (jnp.sin(angles) * attention_factor)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        first, second = x32[..., 0::2], x32[..., 1::2]
    else:
        first, second = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
