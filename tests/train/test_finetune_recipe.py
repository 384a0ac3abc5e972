"""The 128K fine-tune recipe (configs/finetune-128k-tiny.yaml) runs end to end at a reduced seq_len: a random
Hugging Face Llama with the tiny sizes is imported, then trained with context parallelism (ring over 8 devices,
load-balanced, whole documents) from its parameters; the full-size recipes load and validate."""

import dataclasses
import json
import math
import pathlib

import numpy as np
import pytest
import torch
from flax import nnx
from flax.traverse_util import flatten_dict
from transformers import LlamaConfig, LlamaForCausalLM

from models.hf.convert import abstract_model
from models.hf.llama import config_to_hf
from train import hf as cli
from train.checkpoint import restore_model_params
from train.config import RopeScalingConfig, load_config
from train.loop import run

REPO = pathlib.Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "finetune-128k-tiny.yaml"


def test_tiny_recipe_fine_tunes_an_imported_checkpoint_with_context_parallelism(tmp_path):
    recipe = load_config(RECIPE, [f"checkpoint.init_from={tmp_path}"])
    assert recipe.data.seq_len == 131072 and recipe.mesh.context == 8 and recipe.parallel.load_balance
    pretrained = dataclasses.replace(recipe.model, rope_scaling=RopeScalingConfig())  # as trained at 256 tokens
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config_to_hf(pretrained))).save_pretrained(tmp_path / "hf")
    cli.import_checkpoint(tmp_path / "hf", tmp_path / "imported")

    run(
        load_config(
            RECIPE,
            [
                f"checkpoint.init_from={tmp_path / 'imported'}",
                f"train.output_dir={tmp_path / 'run'}",
                "data.seq_len=512",
                "data.max_documents=30",
                "train.steps=2",
                "checkpoint.every_steps=2",
                "optimizer.learning_rate=1e-9",
                "train.progress_bar=false",
                "parallel.block_q=64",
                "parallel.block_kv=64",
                "train.peak_tflops_per_device=1",
            ],
        )
    )  # the MFU's peak given: no CPU matmul benchmark at start
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert abs(losses[0] - math.log(recipe.model.vocab_size)) < 1.0  # a random model's loss, not a trained one's
    shapes = abstract_model(recipe.model)[1]
    imported = flatten_dict(nnx.to_pure_dict(restore_model_params(tmp_path / "imported", shapes)))
    trained = flatten_dict(nnx.to_pure_dict(restore_model_params(tmp_path / "run" / "checkpoints", shapes)))
    assert imported.keys() == trained.keys()
    for key, value in imported.items():  # learning rate 1e-9: the run still holds the imported parameters
        np.testing.assert_allclose(trained[key], value, atol=1e-6, err_msg=str(key))


@pytest.mark.parametrize("name", ["finetune-128k-llama3.1-8b", "finetune-128k-deepseek-v2-lite"])
def test_full_size_recipes_validate(name, tmp_path):
    config = load_config(REPO / "configs" / f"{name}.yaml", [f"checkpoint.init_from={tmp_path}"])
    assert config.data.seq_len == 131072 and config.mesh.context == 8
    assert config.parallel.context_strategy == "ring" and config.compute.remat_policy == "full"
