"""The 128K fine-tune recipes run end to end at a reduced seq_len: the generic one (configs/finetune-128k.yaml) takes
a random Hugging Face Llama of its own sizes to a longer context in one command, resumes and exports; the tiny one
(configs/finetune-128k-tiny.yaml) trains an import of the tiny sizes with context parallelism (ring over 8 devices,
load-balanced, whole documents) from its parameters; the full-size recipes load and validate."""

import dataclasses
import json
import math
import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from models.hf.llama import config_to_hf
from train import hf as cli
from train.__main__ import main
from train.config import RopeScalingConfig, load_config
from train.loop import run

REPO = pathlib.Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "finetune-128k-tiny.yaml"
GENERIC = REPO / "configs" / "finetune-128k.yaml"


def import_llama(directory: pathlib.Path) -> pathlib.Path:
    """A random LlamaForCausalLM with vocab 384 and sizes other than configs/models/tiny.yaml's, trained at 256
    positions with no rope scaling, saved by transformers and imported by the command line; returns the import."""
    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(hf).save_pretrained(directory / "hf")
    assert cli.main(["import", str(directory / "hf"), str(directory / "imported")]) == 0
    return directory / "imported"


@pytest.mark.newest_stack
def test_one_command_takes_an_import_to_a_longer_context_resumes_and_exports(tmp_path, capsys):
    """docs/finetune-128k.md's command at 1024 tokens (rope stretched 4x, llama3 over the 256 trained positions),
    ring over mesh.context=2 and fsdp over the other 4 devices; run again with more steps it resumes; its checkpoint
    exports with the derived rope."""
    imported = import_llama(tmp_path)
    command = [
        str(GENERIC),
        f"checkpoint.init_from={imported}",
        f"train.output_dir={tmp_path / 'run'}",
        "model.context_length=1024",
        "data.seq_len=1024",
        "data.max_documents=30",
        "mesh.context=2",
        "train.batch_size=4",
        "train.grad_accum_steps=1",
        "train.eval_batches=0",
        "train.sample_tokens=0",
        "train.progress_bar=false",
        "checkpoint.every_steps=1",
        "parallel.block_q=64",
        "parallel.block_kv=64",
        "train.peak_tflops_per_device=1",  # the MFU's peak given: no CPU matmul benchmark at start
    ]
    assert main([*command, "train.steps=2"]) == 0
    log = capsys.readouterr().err
    assert f"the model of {imported / 'model.yaml'}" in log
    assert "model.context_length=1024: rope scaling llama3 factor 4 over 256, derived from the model's none" in log
    assert main([*command, "train.steps=3"]) == 0
    assert "resumed from step 2" in capsys.readouterr().err
    steps = [
        m["step"] for m in (json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()) if "loss" in m
    ]
    assert steps == [1, 2, 3]  # the second command went on from step 2
    derived = RopeScalingConfig(type="llama3", factor=4.0, original_max_position_embeddings=256)
    resolved = load_config(tmp_path / "run" / "config.yaml", ["checkpoint.init_from="])  # as evaluate reads a run
    assert resolved.model.rope_scaling == derived and resolved.model.embed_dim == 64

    assert cli.main(["export", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").config.to_dict()
    assert (exported["hidden_size"], exported["vocab_size"], exported["max_position_embeddings"]) == (64, 384, 1024)
    rope = exported["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("llama3", 4.0, 256)


@pytest.mark.slow  # the newest stack's test_one_command_takes_an_import_to_a_longer_context_... runs the same path
def test_tiny_recipe_fine_tunes_an_imported_checkpoint_with_context_parallelism(tmp_path):
    """Six steps of the recipe (ring over 8 devices, load-balanced, whole documents) at its own learning rate: the
    first loss is the imported random model's, and the loss falls, which a wrong gradient or rope would stop."""
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
                "train.steps=6",
                "train.eval_batches=0",
                "checkpoint.every_steps=6",
                "train.progress_bar=false",
                "parallel.block_q=64",
                "parallel.block_kv=64",
                "train.peak_tflops_per_device=1",  # the MFU's peak given: no CPU matmul benchmark at start
            ],
        )
    )
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    assert abs(losses[0] - math.log(recipe.model.vocab_size)) < 0.1  # the imported random model's loss
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize(
    "name",
    [
        "finetune-128k-llama3.1-8b",
        "finetune-128k-deepseek-v2-lite",
        "finetune-128k-qwen3-8b",
        "finetune-128k-qwen3-30b-a3b",
        "finetune-128k-qwen3.5-35b-a3b",
    ],
)
def test_full_size_recipes_validate(name, tmp_path):
    config = load_config(REPO / "configs" / f"{name}.yaml", [f"checkpoint.init_from={tmp_path}"])
    assert config.data.seq_len == 131072 and config.mesh.context == 8
    assert config.parallel.context_strategy == "ring" and config.compute.remat_policy == "full"


def test_the_1m_recipe_stretches_llama_3_1s_rope_and_splits_rows_over_two_hosts(tmp_path):
    """1,048,576 tokens a row: the rope stretched from Llama 3.1's 131072 positions (llama3 factor 8 -> 64 over 8192),
    usp over context 2 (the hosts) x ulysses 8 (a host's GPUs), one row per micro-batch."""
    config = load_config(REPO / "configs" / "finetune-1m-llama3.1-8b.yaml", [f"checkpoint.init_from={tmp_path}"])
    assert config.data.seq_len == config.model.max_position_embeddings == 1048576
    assert (config.model.rope_scaling.factor, config.model.rope_scaling.original_max_position_embeddings) == (64, 8192)
    assert (config.mesh.context, config.mesh.ulysses, config.parallel.context_strategy) == (2, 8, "usp")
    assert config.train.batch_size == config.train.grad_accum_steps


@pytest.mark.parametrize("name", ["finetune-128k-qwen3-8b", "finetune-128k-qwen3-30b-a3b"])
def test_qwen3_recipes_take_yarn_factor_4_over_32768(name, tmp_path):
    """Qwen's documented 128K setting, stated in the recipe: YaRN 4 x 32768 = 131072 positions."""
    model = load_config(REPO / "configs" / f"{name}.yaml", [f"checkpoint.init_from={tmp_path}"]).model
    assert model.rope_scaling == RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=32768)
    assert model.max_position_embeddings == 131072
