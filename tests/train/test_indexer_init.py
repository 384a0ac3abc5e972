"""A model without sparse attention's indexer given one (DeepSeek-V3 made V3.2): the architecture check lets the dense
warm-up add it and names the way out otherwise, and a model item without it restores every other parameter, the
indexer's left to fresh ones. Through the command (slow): `checkpoint.init_from` seeds the run, the warm-up trains the
new indexer alone, so after a step all the others (router bias included) are the checkpoint's; sparse training from
it is refused."""

import dataclasses

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx

import models
from models.hf.convert import abstract_model
from tests.models.test_families import DSA
from tests.train import tiny_run
from train.checkpoints.architecture import check_architecture
from train.checkpoints.checkpoint import read_model_params, restore_model_params
from train.config import load_config
from train.config.imported import MODEL_YAML
from train.errors import CheckpointError
from train.loop import run

DSA_TINY = tiny_run.REPO / "configs" / "deepseek-v3.2-tiny.yaml"
SMALL = [
    "data.seq_len=128",  # rows longer than index_topk 64
    "data.max_documents=30",
    "train.batch_size=8",
    "train.steps=1",
    "train.eval_batches=0",
    "train.sample_tokens=0",
    "train.progress_bar=false",
    "compute.remat_policy=none",
    "checkpoint.every_steps=1",
]


def parameters(output) -> dict:
    """{path: array} of the parameters a run saved at step 1."""
    config = load_config(output / "config.yaml")
    _, abstract = abstract_model(config.model)
    params = restore_model_params(output / "checkpoints" / "1", abstract)
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(params)}


def test_a_model_item_without_an_indexer_seeds_everything_else(tmp_path):
    plain = dataclasses.replace(DSA, index_topk=0, index_heads=0, index_head_dim=0)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "model", nnx.to_pure_dict(nnx.state(models.build(plain, rngs=nnx.Rngs(1)))))
    (tmp_path / MODEL_YAML).write_text(yaml.safe_dump({"model": dataclasses.asdict(plain)}, sort_keys=False))
    warmup = dataclasses.replace(DSA, indexer_training="warmup")
    check_architecture(tmp_path, warmup)
    added = r"index_topk: 0 there, 6 here; index_heads: .*\)\. .* A new indexer trains alone first"
    with pytest.raises(CheckpointError, match=added):
        check_architecture(tmp_path, DSA)
    _, abstract = abstract_model(warmup)
    with pytest.raises(CheckpointError, match=r"10 arrays missing there \(e\.g\. .*indexer"):
        read_model_params(tmp_path, abstract)
    seeded = read_model_params(tmp_path, abstract, may_lack="indexer")
    saved = nnx.state(models.build(plain, rngs=nnx.Rngs(1)))
    fresh = lambda path: "'indexer'" in jax.tree_util.keystr(path)
    leaves = jax.tree_util.tree_leaves_with_path(seeded)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) == fresh(path) for path, leaf in leaves)
    for (path, leaf), want in zip([item for item in leaves if not fresh(item[0])], jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(leaf, want, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_a_new_indexer_trains_alone_from_a_checkpoint_without_one(tmp_path):
    dense = tmp_path / "dense"
    run(
        load_config(
            DSA_TINY,
            [
                *SMALL,
                f"train.output_dir={dense}",
                "model.index_topk=0",
                "model.index_heads=0",
                "model.index_head_dim=0",
            ],
        )
    )
    seeded = [*SMALL, f"checkpoint.init_from={dense / 'checkpoints'}"]
    added = r"index_topk: 0 there, 64 here; index_heads: .*\)\. .* A new indexer trains alone first"
    with pytest.raises(CheckpointError, match=added):
        run(load_config(DSA_TINY, [*seeded, f"train.output_dir={tmp_path / 'sparse'}"]))
    assert not (tmp_path / "sparse").exists()
    warm = tmp_path / "warm"
    run(load_config(DSA_TINY, [*seeded, f"train.output_dir={warm}", "model.indexer_training=warmup"]))
    before, after = parameters(dense), parameters(warm)
    added = after.keys() - before.keys()
    assert added and all("['indexer']" in name for name in added)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert tiny_run.records(warm)[-1]["indexer_loss"] > 0
