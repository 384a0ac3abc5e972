"""Resharding restore: a checkpoint written on one mesh restores onto another through orbax target shardings,
both as a full resume (model + optimizer state + data position) and as params-only `checkpoint.init_from`.
Restored values equal the saved ones and every restored array carries the new mesh's sharding. (The sequence
length is no part of the state, so a run may also resume at another `data.seq_len`.)"""

import grain
import jax
import numpy as np
import pytest

from parallel.mesh import make_mesh
from tests.tiny_models import TINY_LLAMA
from train.checkpoints.checkpoint import Checkpointer, restore_model_params
from train.config import MeshConfig, OptimizerConfig
from train.optimizer import make_optimizer
from train.state import abstract_state

MODEL = TINY_LLAMA
TX = make_optimizer(OptimizerConfig(), 10)
STEP, ITEMS_READ = 7, 3
MESHES = {
    "fsdp8": MeshConfig(fsdp=8),
    "tensor2_fsdp4": MeshConfig(fsdp=4, tensor=2),
    "context8": MeshConfig(fsdp=1, context=8),
    "data2_context4": MeshConfig(data=2, fsdp=1, context=4),
    "fsdp2_context2_tensor2": MeshConfig(fsdp=2, context=2, tensor=2),
}
MOVES = [("fsdp8", "context8"), ("tensor2_fsdp4", "data2_context4"), ("context8", "fsdp2_context2_tensor2")]


def data_iterator():
    return iter(grain.MapDataset.range(100).to_iter_dataset())


def random_values(abstract, seed: int):
    """Host arrays shaped like `abstract`'s leaves: normal floats, integers in [1, 100)."""
    rng = np.random.default_rng(seed)

    def one(leaf):
        if np.issubdtype(leaf.dtype, np.floating):
            return rng.standard_normal(leaf.shape).astype(leaf.dtype)
        return rng.integers(1, 100, leaf.shape).astype(leaf.dtype)

    return jax.tree.map(one, abstract)


def assert_restored(restored, expected_values, expected_shardings):
    """Same values as `expected_values` (host arrays) and the same shardings as `expected_shardings`."""
    values = jax.tree_util.tree_leaves_with_path(expected_values)
    arrays, shardings = jax.tree.leaves(restored), jax.tree.leaves(expected_shardings)
    assert len(arrays) == len(values) == len(shardings)
    for (path, value), array, sharding in zip(values, arrays, shardings, strict=True):
        name = jax.tree_util.keystr(path)
        assert array.sharding == sharding, (name, array.sharding, sharding)
        assert array.dtype == value.dtype, name
        np.testing.assert_array_equal(np.asarray(array), value, err_msg=name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{source mesh name: (checkpoint directory, host values of the saved (model, optimizer) state)}."""
    result = {}
    for seed, name in enumerate(sorted({source for source, _ in MOVES})):
        _, abstract, shardings = abstract_state(MODEL, TX, make_mesh(MESHES[name]))
        values = random_values(abstract, seed)
        state = jax.device_put(values, shardings)
        iterator = data_iterator()
        for _ in range(ITEMS_READ):
            next(iterator)
        directory = tmp_path_factory.mktemp(name) / "checkpoints"
        checkpointer = Checkpointer(directory, keep=1)
        checkpointer.save(STEP, state, iterator, {"config": {"mesh": name}})
        checkpointer.wait()
        checkpointer.close()
        result[name] = directory, values
    return result


@pytest.mark.parametrize("source, target", MOVES, ids=[f"{s}-to-{t}" for s, t in MOVES])
def test_full_resume_onto_another_mesh(saved, source, target):
    directory, values = saved[source]
    _, abstract, shardings = abstract_state(MODEL, TX, make_mesh(MESHES[target]))
    iterator = data_iterator()
    checkpointer = Checkpointer(directory, keep=1)
    step, state = checkpointer.restore_latest(abstract, iterator)
    checkpointer.close()
    assert step == STEP
    assert_restored(state, values, shardings)
    assert next(iterator) == ITEMS_READ


@pytest.mark.parametrize("source, target", MOVES, ids=[f"{s}-to-{t}" for s, t in MOVES])
@pytest.mark.parametrize("which", ["checkpoints", "step"])
def test_params_only_init_onto_another_mesh(saved, source, target, which):
    directory, values = saved[source]
    _, abstract, shardings = abstract_state(MODEL, TX, make_mesh(MESHES[target]))
    params = restore_model_params(directory if which == "checkpoints" else directory / str(STEP), abstract[0])
    assert_restored(params, values[0], shardings[0])
