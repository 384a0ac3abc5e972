"""How DeepSeek-V3.2's indexer trains (model.indexer_training, model.indexer_loss_coef) in a train step of a tiny
sparse-attention model: sparse training moves the model and the indexer, and the indexer's gradient is its loss's
alone (doubling the coefficient doubles it and leaves every other gradient as it was); frozen leaves the indexer as it
was (weight decay included) and warmup everything else (the router bias included), with the optimizer's state the
same shape in every way; the loss is logged in each; bad settings are named."""

import dataclasses

import jax
import numpy as np
import pytest

from models.config import ConfigError, check_model
from parallel.mesh import batch_sharding, make_mesh
from tests.models.test_families import DSA, PLAIN
from tests.tiny_models import TINY_MLA
from tests.train.step_reference import COMPUTE, first_step, initial_state, packed_batch
from train.config import MeshConfig, OptimizerConfig
from train.optimizer import make_optimizer
from train.state import create_state
from train.step import make_train_step


def one_update(model):
    """(parameters before, after, the optimizer state's tree structure, metrics) of one AdamW step with weight decay."""
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    tx = make_optimizer(OptimizerConfig(warmup_steps=0, weight_decay=0.1), 10)
    state = create_state(model, tx, mesh, seed=0, compute=COMPUTE)
    before = jax.device_get(state.state)
    step = make_train_step(state, mesh, chunk_size=32, accum_steps=1)
    with jax.set_mesh(mesh):
        after, metrics = step(state.state, jax.device_put(packed_batch(model.vocab_size), batch_sharding(mesh)))
    paths = lambda tree: {
        jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)
    }
    structure = jax.tree.structure(jax.eval_shape(lambda: after[1]))
    return paths(before[0]), paths(jax.device_get(after[0])), structure, metrics


@pytest.fixture(scope="module")
def sparse_state():
    return initial_state(DSA)


def test_sparse_training_gives_the_indexer_its_own_loss_gradient_only(sparse_state):
    losses, grads = first_step(sparse_state, DSA, MeshConfig(fsdp=1), PLAIN, jax.devices()[:1])
    doubled = dataclasses.replace(DSA, indexer_loss_coef=2.0)
    losses2, grads2 = first_step(sparse_state, doubled, MeshConfig(fsdp=1), PLAIN, jax.devices()[:1])
    np.testing.assert_allclose(losses2, losses, rtol=1e-6)
    assert len(losses) == 2 and losses[1] > 0.01  # the token loss and the indexer's loss
    indexer = {name for name in grads if "['indexer']" in name}
    assert len(indexer) == 10  # wq_b, wk, k_norm's scale and bias, weights; in the dense and the MoE layers
    for name, grad in grads.items():
        if name in indexer:
            assert np.linalg.norm(grad) > 0 and np.allclose(grads2[name], 2 * grad, rtol=1e-5, atol=1e-9), name
        else:
            np.testing.assert_allclose(grads2[name], grad, rtol=1e-6, atol=1e-9, err_msg=name)


def test_frozen_and_warmup_keep_their_parameters_as_they_were():
    biased = dataclasses.replace(DSA, router_score="sigmoid", router_bias_rate=0.01)  # the warm-up keeps the bias too
    results = {way: one_update(dataclasses.replace(biased, indexer_training=way)) for way in ("frozen", "warmup")}
    for way, (before, after, _, metrics) in results.items():
        assert float(metrics["indexer_loss"]) > 0.01, way
        for name, value in before.items():
            frozen = ("['indexer']" in name) == (way == "frozen")
            kind = name.rsplit("'", 2)[-2] if "['" in name else name
            if frozen:
                np.testing.assert_array_equal(after[name], value, err_msg=f"{way}: {name}")
            elif kind not in ("bias", "scale") or "['moe']['bias']" in name:  # norms may not move in one step
                assert np.any(after[name] != value), f"{way}: {name} did not move"
    assert results["frozen"][2] == results["warmup"][2]  # the optimizer's state: the same shape either way


def test_rows_no_longer_than_index_topk_attend_densely_without_the_loss(sparse_state):
    """Rows of 64 tokens under index_topk 64: the token loss is dense attention's (the warm-up's, which attends
    densely), no indexer loss is reported and none reaches the indexer (the warm-up still has one)."""
    dense = dataclasses.replace(DSA, index_topk=64)
    losses, grads = first_step(sparse_state, dense, MeshConfig(fsdp=1), PLAIN, jax.devices()[:1])
    warmup = dataclasses.replace(DSA, indexer_training="warmup")
    warm_losses, _ = first_step(sparse_state, warmup, MeshConfig(fsdp=1), PLAIN, jax.devices()[:1])
    assert len(losses) == 1 and len(warm_losses) == 2 and warm_losses[1] > 0.01
    np.testing.assert_allclose(losses[0], warm_losses[0], rtol=1e-6)
    indexer = {name: grad for name, grad in grads.items() if "['indexer']" in name}
    assert len(indexer) == 10 and not any(np.any(grad) for grad in indexer.values())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(indexer_training="dense"), r"model\.indexer_training='dense': choose one of sparse, frozen, warmup"),
        (dict(indexer_loss_coef=-1.0), r"model\.indexer_loss_coef=-1\.0 must be >= 0"),
    ],
)
def test_bad_indexer_training_is_named(change, message):
    with pytest.raises(ConfigError, match=message):
        check_model(dataclasses.replace(DSA, **change))


def test_a_model_without_an_indexer_cannot_train_one():
    with pytest.raises(ConfigError, match=r"model\.indexer_training='warmup' trains sparse attention's indexer; this"):
        check_model(dataclasses.replace(TINY_MLA, indexer_training="warmup"))
