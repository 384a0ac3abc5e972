"""Multi-head latent attention against a float64 NumPy transcription of Hugging Face `DeepseekV3Attention`."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers.mla import MLA
from layers.rope import inverse_frequencies
from train.config import RopeScalingConfig

EMBED, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V = 32, 4, 24, 16, 8, 8, 12
THETA, EPS = 10000.0, 1e-6
YARN = RopeScalingConfig(
    type="yarn",
    factor=40.0,
    original_max_position_embeddings=16,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)


def make_model(q_lora_rank, scaling, seed=0):
    model = MLA(
        EMBED,
        HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        rope_theta=THETA,
        rope_scaling=scaling,
        norm_eps=EPS,
        rngs=nnx.Rngs(seed),
    )
    rng = np.random.default_rng(seed + 100)
    norms = [model.kv_a_norm] + ([model.q_a_norm] if q_lora_rank else [])
    for norm in norms:  # non-trivial norm scales, so that their use is checked too
        norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
    return model


def packed_inputs(seed=1, batch=2, length=12):
    """x [batch, length, embed]; two documents and padding in row 0, one document in row 1."""
    x = np.random.default_rng(seed).normal(size=(batch, length, EMBED)).astype(np.float32)
    segment_ids = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * length], np.int32)
    positions = np.array([list(range(5)) + list(range(4)) + [0] * 3, list(range(length))], np.int32)
    return x, positions, segment_ids


def param_arrays(model):
    """{"q_a": array, "q_a_norm/scale": array, ...} of the model's params."""
    return {"/".join(map(str, path)): var[...] for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def rms_norm(x, scale):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + EPS) * scale


def rope_interleaved(x, positions, inv_freq, attention_factor):
    """Hugging Face `apply_rotary_pos_emb_interleave` on x [batch, length, heads, dim]."""
    b, t, h, d = x.shape
    x = x.reshape(b, t, h, d // 2, 2).swapaxes(-1, -2).reshape(b, t, h, d)
    freqs = positions[..., None].astype(np.float64) * inv_freq.astype(np.float64)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = np.cos(emb) * attention_factor, np.sin(emb) * attention_factor
    rotated_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * cos + rotated_half * sin


def reference(model, x, positions, segment_ids, scaling, softmax_multiplier):
    p = {name: np.asarray(value, np.float64) for name, value in param_arrays(model).items()}
    x = x.astype(np.float64)
    if "q_a" in p:
        q = np.einsum("btr,rhd->bthd", rms_norm(x @ p["q_a"], p["q_a_norm/scale"]), p["q_b"])
    else:
        q = np.einsum("bte,ehd->bthd", x, p["q"])
    compressed = x @ p["kv_a"]
    kv = np.einsum("btr,rhd->bthd", rms_norm(compressed[..., :KV_LORA], p["kv_a_norm/scale"]), p["kv_b"])
    inv_freq, _ = inverse_frequencies(ROPE, THETA, scaling)
    attention_factor = 1.0
    if scaling is not None:
        attention_factor = (0.1 * scaling.mscale * math.log(scaling.factor) + 1) / (
            0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1
        )
    q_pe = rope_interleaved(q[..., NOPE:], positions, inv_freq, attention_factor)
    k_pe = rope_interleaved(compressed[..., None, KV_LORA:], positions, inv_freq, attention_factor)
    query = np.concatenate([q[..., :NOPE], q_pe], axis=-1)
    key = np.concatenate([kv[..., :NOPE], np.repeat(k_pe, HEADS, axis=2)], axis=-1)
    value = kv[..., NOPE:]
    logits = np.einsum("bqhd,bkhd->bhqk", query, key) * (NOPE + ROPE) ** -0.5 * softmax_multiplier
    t = x.shape[1]
    seg = np.ones(x.shape[:2], np.int32) if segment_ids is None else segment_ids
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0) & np.tril(np.ones((t, t), bool))
    logits = np.where(mask[:, None], logits, -np.inf)
    row_max = np.max(logits, axis=-1, keepdims=True)
    weights = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))
    weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)
    out = np.einsum("bhqk,bkhd->bqhd", weights, value)
    return np.einsum("bthd,hde->bte", out, p["o"])


def yarn_softmax_multiplier(scaling):
    return 1.0 if scaling is None else (0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1) ** 2


def assert_close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("scaling", [None, YARN], ids=["no_scaling", "yarn"])
@pytest.mark.parametrize("q_lora_rank", [Q_LORA, 0], ids=["q_lora", "q_full"])
def test_matches_reference_packed(q_lora_rank, scaling):
    model = make_model(q_lora_rank, scaling)
    x, positions, segment_ids = packed_inputs()
    out = model(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segment_ids))
    assert out.shape == x.shape and out.dtype == jnp.float32
    expected = reference(model, x, positions, segment_ids, scaling, yarn_softmax_multiplier(scaling))
    assert_close(np.asarray(out), expected)
    np.testing.assert_array_equal(np.asarray(out)[0, 9:], 0.0)  # padding queries see no key


def test_param_shapes_and_names():
    shapes = {name: value.shape for name, value in param_arrays(make_model(Q_LORA, None)).items()}
    assert shapes == {
        "q_a": (EMBED, Q_LORA),
        "q_a_norm/scale": (Q_LORA,),
        "q_b": (Q_LORA, HEADS, NOPE + ROPE),
        "kv_a": (EMBED, KV_LORA + ROPE),
        "kv_a_norm/scale": (KV_LORA,),
        "kv_b": (KV_LORA, HEADS, NOPE + V),
        "o": (HEADS, V, EMBED),
    }
    full = {name: value.shape for name, value in param_arrays(make_model(0, None)).items()}
    assert full["q"] == (EMBED, HEADS, NOPE + ROPE) and "q_a" not in full and "q_b" not in full


def test_yarn_softmax_factor_changes_output():
    scaling = RopeScalingConfig(
        type="yarn", factor=40.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0
    )  # DeepSeek-V3: rotary factor 1, softmax factor mscale ** 2
    model = make_model(Q_LORA, scaling)
    x, positions, _ = packed_inputs()
    out = np.asarray(model(jnp.asarray(x), jnp.asarray(positions)))
    with_factor = reference(model, x, positions, None, scaling, yarn_softmax_multiplier(scaling))
    without_factor = reference(model, x, positions, None, scaling, 1.0)
    assert_close(out, with_factor)
    assert np.abs(with_factor - without_factor).max() > 100 * np.abs(out - with_factor).max()


def test_jit_and_gradients_reach_every_param():
    model = make_model(Q_LORA, YARN)
    x, positions, segment_ids = packed_inputs()
    graphdef, params = nnx.split(model, nnx.Param)
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=x.shape), jnp.float32)

    @jax.jit
    def loss_and_out(params, x):
        out = nnx.merge(graphdef, params)(x, jnp.asarray(positions), jnp.asarray(segment_ids))
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss_and_out, has_aux=True)(params, jnp.asarray(x))
    np.testing.assert_allclose(
        out, model(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segment_ids)), rtol=1e-5, atol=1e-6
    )
    flat = nnx.to_flat_state(grads)
    assert len(flat) == 7
    for name, grad in flat:
        grad = np.asarray(grad[...])
        assert np.all(np.isfinite(grad)) and np.abs(grad).max() > 0, name
