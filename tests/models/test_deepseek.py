"""The DeepSeek-like model: shapes, expert loads as aux, the aux-loss-free router-bias update after the
optimizer step (outside the gradient), and the tiny config training over context, tensor and expert axes."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from layers.moe import RouterBias
from parallel.mesh import make_mesh
from train.config import MeshConfig, load_config
from train.loop import run
from train.state import create_state
from train.step import make_train_step

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = load_config(REPO / "configs" / "deepseek-tiny.yaml", ["compute.dtype=float32"]).model


def tokens(batch=2, length=32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, TINY.vocab_size, (batch, length)), jnp.int32)


def test_logits_and_expert_loads():
    model = models.build(TINY, rngs=nnx.Rngs(0))
    assert model(tokens()).shape == (2, 32, TINY.vocab_size)
    _, aux = model.hidden(tokens())
    moe_layers = TINY.num_layers - TINY.first_dense_layers
    assert aux["expert_counts"].shape == (moe_layers, 2, TINY.num_experts)  # per layer and row
    np.testing.assert_array_equal(aux["expert_counts"].sum(-1), 32 * TINY.experts_per_token)
    np.testing.assert_array_equal(aux["expert_dropped"], np.zeros(moe_layers))


def test_all_dense_without_experts():
    config = TINY.__class__(**{**TINY.__dict__, "num_experts": 0})
    model = models.build(config, rngs=nnx.Rngs(0))
    assert model.moe_layers is None and model.hidden(tokens())[1] == {}


def test_balance_raises_the_bias_of_under_loaded_experts():
    model = models.build(TINY, rngs=nnx.Rngs(0))
    counts = jnp.asarray([[[10.0, 0, 0, 0, 0, 0, 0, 2], [0, 0, 0, 0, 0, 0, 0, 4]]] * 2)  # [layers, rows, experts]
    metrics = model.balance({"expert_counts": counts, "expert_dropped": jnp.asarray([2.0, 0.0])})
    bias = np.asarray(model.moe_layers.moe.bias[...])
    rate = TINY.router_bias_rate
    np.testing.assert_allclose(bias[:, 0], -rate)
    np.testing.assert_allclose(bias[:, 1], rate)
    np.testing.assert_allclose(float(metrics["expert_imbalance"]), 10.0 / 2.0)
    np.testing.assert_allclose(float(metrics["expert_dropped"]), 2.0 / 32.0)


def test_router_bias_is_not_a_parameter():
    model = models.build(TINY, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    biases = nnx.state(model, RouterBias)
    assert jax.tree.leaves(biases) and not any(
        "bias" in str(path) and "mlp" in str(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )


@pytest.mark.newest_stack
def test_tiny_config_trains_over_context_tensor_and_expert_axes(tmp_path):
    run(
        load_config(
            REPO / "configs" / "deepseek-tiny.yaml",
            [
                "mesh.fsdp=1",
                "mesh.context=2",
                "mesh.tensor=2",
                "mesh.expert=2",
                "parallel.context_strategy=ring",
                "data.seq_len=64",
                "data.max_documents=60",
                "train.steps=8",
                "train.log_every_steps=1",
                "train.eval_batches=0",
                "train.sample_tokens=0",
                "train.progress_bar=false",
                "optimizer.warmup_steps=0",
                "optimizer.learning_rate=3e-3",
                "checkpoint.enabled=false",
                "compute.dtype=float32",
                "train.peak_tflops_per_device=1",  # the MFU's peak given: no CPU matmul benchmark at start
                f"train.output_dir={tmp_path}",
            ],
        )
    )
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.5, logged
    assert all(np.isfinite(r["loss"]) and r["expert_imbalance"] >= 1.0 for r in logged)


def test_train_step_moves_the_router_bias_outside_the_gradient():
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    state = create_state(TINY, optax.sgd(0.0), mesh, seed=0)  # zero learning rate: only the bias may move
    ids = np.asarray(tokens(4, 32))
    batch = dict(
        tokens=ids,
        targets=np.roll(ids, -1, 1),
        segment_ids=np.ones_like(ids),
        positions=np.tile(np.arange(32, dtype=np.int32), (4, 1)),
        loss_mask=np.ones(ids.shape, np.float32),
    )
    step = make_train_step(state, mesh, chunk_size=32, accum_steps=2)
    with jax.set_mesh(mesh):
        new_state, metrics = step(jax.tree.map(jnp.copy, state.state), batch)
    model = nnx.merge(state.graphdef, new_state)[0]
    bias = np.asarray(model.moe_layers.moe.bias[...])
    assert np.all(np.isin(np.round(bias / TINY.router_bias_rate), [-1, 0, 1])) and np.any(bias != 0)
    assert float(metrics["expert_imbalance"]) >= 1.0
    before = nnx.merge(state.graphdef, state.state)[0]
    np.testing.assert_array_equal(
        np.asarray(model.moe_layers.moe.experts_up[...]), np.asarray(before.moe_layers.moe.experts_up[...])
    )
