"""Mesh from config, logical-axis rules, and sharded training equal to one device."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from parallel.mesh import MeshError, batch_sharding, check_batch, logical_spec, make_mesh, mesh_shape
from tests.tiny_models import TINY_LLAMA
from train.config import MeshConfig, OptimizerConfig
from train.optimizer import make_optimizer
from train.state import create_state
from train.step import make_train_step


def test_fill_axis_takes_the_remaining_devices():
    assert mesh_shape({"data": 2, "fsdp": -1, "context": 1, "tensor": 2}, 8) == {
        "data": 2,
        "fsdp": 2,
        "context": 1,
        "tensor": 2,
    }


@pytest.mark.parametrize(
    "sizes, words",
    [
        ({"data": 3, "fsdp": -1, "context": 1, "tensor": 1}, ["8 devices", "3"]),
        ({"data": 2, "fsdp": 2, "context": 1, "tensor": 1}, ["uses 4 devices", "8 are available"]),
    ],
)
def test_sizes_that_do_not_fit_the_devices(sizes, words):
    with pytest.raises(MeshError) as info:
        mesh_shape(sizes, 8)
    assert all(word in str(info.value) for word in words)


def test_logical_rules_drop_repeated_and_trivial_axes():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, context=1, tensor=2))
    assert mesh.shape == {"data": 2, "fsdp": 2, "expert": 1, "context": 1, "ulysses": 1, "tensor": 2}
    assert logical_spec(("batch", "length", "embed"), mesh) == PartitionSpec(("data", "fsdp"), None, None)
    assert logical_spec(("embed", "heads", "head_dim"), mesh) == PartitionSpec("fsdp", "tensor", None)
    assert logical_spec(("layers", "embed", "mlp"), mesh) == PartitionSpec(None, "fsdp", "tensor")


def test_length_shards_over_context_then_ulysses():
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, context=2, ulysses=2))
    assert mesh.axis_names == ("data", "fsdp", "expert", "context", "ulysses", "tensor")
    assert logical_spec(("batch", "length"), mesh) == PartitionSpec("data", ("context", "ulysses"))
    mesh = make_mesh(MeshConfig(fsdp=2, context=4))
    assert logical_spec(("batch", "length"), mesh) == PartitionSpec("fsdp", "context")


def test_experts_shard_over_expert_which_also_splits_the_batch():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=2, tensor=2))
    # experts over expert, then over the sequence axes that still divide them (expert parallelism)
    assert logical_spec(("experts", "embed", "mlp"), mesh, (8, 16, 16)) == PartitionSpec(
        ("expert", "tensor"), "fsdp", None
    )
    assert logical_spec(("experts", "embed", "mlp"), mesh, (2, 16, 16)) == PartitionSpec("expert", "fsdp", "tensor")
    assert logical_spec(("batch", "length"), mesh) == PartitionSpec(("fsdp", "expert"), None)
    with pytest.raises(MeshError, match="data x fsdp x expert = 4"):
        check_batch(6, 1, mesh)


def test_batch_must_split_over_data_and_fsdp():
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    check_batch(16, 2, mesh)
    with pytest.raises(MeshError, match=r"train\.batch_size=12 / train\.grad_accum_steps=1 must be divisible by .* 8"):
        check_batch(12, 1, mesh)


def one_step(mesh_config, devices):
    model = dataclasses.replace(TINY_LLAMA, num_layers=2)
    mesh = make_mesh(mesh_config, devices)
    state = create_state(model, make_optimizer(OptimizerConfig(warmup_steps=0), 10), mesh, seed=0)
    step = make_train_step(state, mesh, chunk_size=8, accum_steps=2)
    rng = np.random.default_rng(0)
    batch = {key: rng.integers(0, 64, (16, 16)).astype(np.int32) for key in ("tokens", "targets")}
    batch.update(
        segment_ids=np.ones((16, 16), np.int32),
        positions=np.tile(np.arange(16, dtype=np.int32), (16, 1)),
        loss_mask=np.ones((16, 16), np.float32),
    )  # micro-batches of 8 rows: one per data x fsdp shard
    batch = jax.device_put(batch, batch_sharding(mesh))
    with jax.set_mesh(mesh):
        new_state, metrics = step(state.state, batch)
        _, metrics2 = step(new_state, batch)
    return float(metrics["loss"]), float(metrics2["loss"]), float(metrics["grad_norm"])


@pytest.fixture(scope="module")
def reference():
    return one_step(MeshConfig(fsdp=1), jax.devices()[:1])


@pytest.mark.parametrize(
    "mesh_config", [MeshConfig(fsdp=8), MeshConfig(data=2, fsdp=4)], ids=["fsdp8", "data2-fsdp4"]
)  # tensor meshes: tests/train/test_tensor_parallel.py
def test_sharded_steps_equal_one_device(mesh_config, reference):
    np.testing.assert_allclose(one_step(mesh_config, jax.devices()), reference, rtol=1e-5)
