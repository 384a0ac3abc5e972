"""Optimizer: schedule shape, the rate each update uses, weight-decay mask, the first moment's dtype (and a
checkpoint of another refused on resume), gradient accumulation equals one big batch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from train.checkpoints.checkpoint import structure_difference
from train.config import ComputeConfig, ConfigError, ModelConfig, OptimizerConfig, load_config
from train.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from train.step import accumulated_grads, frozen_mask


def test_warmup_from_above_zero_then_cosine_to_min_ratio():
    """schedule(count) is the rate of update count + 1: the first update learns, update 10 is at the peak and the
    last one (110 = train.steps) at the floor."""
    schedule = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1), 110)
    assert float(schedule(0)) == pytest.approx(0.1) and float(schedule(4)) == pytest.approx(0.5)
    assert float(schedule(9)) == pytest.approx(1.0)
    assert float(schedule(59)) == pytest.approx(0.55, rel=1e-5)  # half way down the cosine
    assert float(schedule(109)) == pytest.approx(0.1) and float(schedule(200)) == pytest.approx(0.1)


@pytest.mark.parametrize("warmup_steps", [0, 1])
def test_without_warmup_the_first_update_is_at_the_peak(warmup_steps):
    schedule = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, warmup_steps=warmup_steps), 10)
    assert float(schedule(0)) == pytest.approx(1.0) and float(schedule(9)) == pytest.approx(0.1)


def test_each_update_uses_the_scheduled_rate():
    """A constant gradient makes Adam's bias-corrected step 1 per element, so each update is -learning rate."""
    config = OptimizerConfig(learning_rate=0.1, warmup_steps=3, weight_decay=0.0, clip_norm=0.0)
    tx, schedule = make_optimizer(config, 6), learning_rate_schedule(config, 6)
    params = {"w": jnp.zeros(4)}
    state = tx.init(params)
    for count in range(6):
        updates, state = tx.update({"w": jnp.ones(4)}, state, params)
        np.testing.assert_allclose(updates["w"], -float(schedule(count)), rtol=1e-5)


def test_weight_decay_spares_norm_scales():
    model = nnx.eval_shape(
        lambda: models.build(
            ModelConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32),
            rngs=nnx.Rngs(0),
        )
    )
    mask = nnx.to_pure_dict(decay_mask(nnx.state(model, nnx.Param)))
    assert mask["layers"]["attn_norm"]["scale"] is False and mask["final_norm"]["scale"] is False
    assert mask["layers"]["attn"]["q"] is True and mask["embed"]["embedding"] is True


def test_weight_decay_spares_biases_and_sinks():
    """GPT-OSS's attention and expert biases, router logit bias and sinks are not decayed; its matrices are."""
    config = ModelConfig(
        family="gpt_oss",
        vocab_size=32,
        embed_dim=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        mlp_dim=32,
        qkv_bias=True,
        o_bias=True,
        attention_sinks=True,
        num_experts=4,
        experts_per_token=2,
        moe_mlp_dim=8,
        router_score="softmax",
        router_bias_rate=0.0,
        router_logit_bias=True,
        expert_mlp="clamped_swiglu",
    )
    model = nnx.eval_shape(lambda: models.build(config, rngs=nnx.Rngs(0)))
    mask = nnx.to_pure_dict(decay_mask(nnx.state(model, nnx.Param)))["moe_layers"]
    attn, moe = mask["attn"], mask["moe"]
    assert not any([attn["q_bias"]["bias"], attn["o_bias"]["bias"], attn["sinks"], moe["router_bias"]])
    assert not moe["experts_gate_up_bias"] and not moe["experts_down_bias"]
    assert attn["o"] and moe["router"] and moe["experts_gate_up"] and moe["experts_down"]


@pytest.mark.parametrize(
    "mu_dtype, param_dtype, mu, nu",
    [
        ("param", jnp.float32, jnp.float32, jnp.float32),
        ("float32", jnp.float32, jnp.float32, jnp.float32),
        ("bfloat16", jnp.float32, jnp.bfloat16, jnp.float32),
        ("param", jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_first_moment_takes_mu_dtype_second_the_params(mu_dtype, param_dtype, mu, nu):
    """mu [4] is stored in mu_dtype before and after an update; nu [4] in the parameters' dtype."""
    tx = make_optimizer(OptimizerConfig(mu_dtype=mu_dtype), 10)
    params = {"w": jnp.ones(4, param_dtype)}
    _, state = tx.update({"w": jnp.full(4, 0.1, param_dtype)}, tx.init(params), params)
    adam = state[1][0]
    assert adam.mu["w"].dtype == mu and adam.nu["w"].dtype == nu
    np.testing.assert_allclose(np.asarray(adam.mu["w"], np.float32), 0.01, rtol=1e-2)  # (1 - b1) * 0.1


def test_a_mu_dtype_outside_the_choices_is_one_line():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optimizer.mu_dtype=float16"])
    assert str(info.value) == "optimizer.mu_dtype='float16' is not allowed; choose one of param, float32, bfloat16"


def test_a_checkpoint_of_other_moment_dtypes_does_not_fit():
    """A resume compares dtypes too (a restore would cast): float32 moments saved, bfloat16 asked."""
    params = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
    saved, asked = (
        jax.eval_shape(make_optimizer(OptimizerConfig(mu_dtype=dtype), 10).init, params)
        for dtype in ("float32", "bfloat16")
    )
    assert structure_difference(saved, asked) == ""  # keys and shapes alike: what a parameters-only read checks
    difference = structure_difference(saved, asked, dtypes=True)  # the path of optax's state here, a dict's there
    assert re.fullmatch(r"1 arrays of another dtype \(e\.g\. \S*mu/w: float32 there, bfloat16 here\)", difference)


def test_gradient_accumulation_equals_one_batch():
    config = ModelConfig(vocab_size=32, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32)
    model = models.build(config, ComputeConfig(remat_policy="none"), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    segment_ids = np.repeat([[1] * 10 + [2] * 4 + [0] * 2], 4, 0).astype(np.int32)
    segment_ids[1, 8:] = 0  # rows with different token counts: the mean must weight tokens, not rows
    batch = dict(
        tokens=rng.integers(0, 32, (4, 16)).astype(np.int32),
        targets=rng.integers(0, 32, (4, 16)).astype(np.int32),
        segment_ids=segment_ids,
        positions=np.tile(np.arange(16, dtype=np.int32), (4, 1)),
        loss_mask=(segment_ids > 0).astype(np.float32),
    )
    frozen = frozen_mask(model.config)(nnx.state(model, nnx.Param))  # all False: a llama freezes nothing
    one = accumulated_grads(model, batch, 8, 1, frozen)
    four = accumulated_grads(model, batch, 8, 4, frozen)
    np.testing.assert_allclose(one[1], four[1], rtol=1e-6)
    assert float(one[2]) == float(four[2]) == float(batch["loss_mask"].sum())
    # float32 sums in another order: an element's error is relative to the size of what was summed (the gradient's
    # scale), not to the element, which may be near zero after cancellation (seen: 1.8e-7 on -2.7e-3)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(np.abs(b).max()))
    jax.tree.map(close, one[0], four[0])
