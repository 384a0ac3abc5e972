"""Optimizer: schedule shape, the rate each update uses, weight-decay mask, gradient accumulation equals one big
batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from train.config import ComputeConfig, ModelConfig, OptimizerConfig
from train.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from train.step import accumulated_grads


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
    one = accumulated_grads(model, batch, 8, 1)
    four = accumulated_grads(model, batch, 8, 4)
    np.testing.assert_allclose(one[1], four[1], rtol=1e-6)
    assert float(one[2]) == float(four[2]) == float(batch["loss_mask"].sum())
    # float32 sums in another order: an element's error is relative to the size of what was summed (the gradient's
    # scale), not to the element, which may be near zero after cancellation (seen: 1.8e-7 on -2.7e-3)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 * float(np.abs(b).max()))
    jax.tree.map(close, one[0], four[0])
