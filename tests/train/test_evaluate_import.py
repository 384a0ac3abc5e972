"""`python -m train.evaluate` on `python -m train.hf import`'s output: a tiny random Hugging Face Llama with its own
tokenizer.json is imported, then evaluated with the import's model.yaml and tokenizer, or with a run config named
by --config; bad input (and a run without a checkpoint, before any data is read) stops with exit status 2 and a
message naming it."""

import json
import pathlib
import re
import string

import pytest
import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from train import hf as cli
from train.config import load_config, to_dict
from train.evaluate import main as evaluate_main

VOCAB = 128  # below the byte tokenizer's 259 ids: only the import's own tokenizer fits the model
TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 20
REPO = pathlib.Path(__file__).resolve().parents[2]
GRID = ["--lengths", "256", "--depths", "0,1", "--tasks", "single", "--samples", "2"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """An import's OUT (model, model.yaml, hf_config.json, tokenizer.json) and a text file for the filler."""
    root = tmp_path_factory.mktemp("import")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=list(string.printable.strip())
    )
    tokenizer.train_from_iterator([TEXT], trainer)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "hf")
    tokenizer.save(str(root / "hf" / "tokenizer.json"))
    cli.import_checkpoint(root / "hf", root / "out")
    (root / "text.txt").write_text(TEXT)
    return root


def test_an_import_is_evaluated_with_its_model_yaml_and_tokenizer(imported):
    assert evaluate_main([str(imported / "out"), *GRID, f"data.source={imported / 'text.txt'}"]) == 0
    records = json.loads((imported / "out" / "eval" / "needle.json").read_text())
    assert [(r["task"], r["length"], r["depth"]) for r in records] == [("single", 256, 0.0), ("single", 256, 1.0)]
    assert (imported / "out" / "eval" / "needle.png").is_file()


def test_config_names_the_run_config_of_an_import(imported, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"base: {imported / 'out' / 'model.yaml'}\n"
        f"data: {{source: {imported / 'text.txt'}, tokenizer: {imported / 'out' / 'tokenizer.json'}}}\n"
    )
    assert evaluate_main([str(imported / "out"), "--config", str(config), *GRID, "--out", str(tmp_path)]) == 0
    assert len(json.loads((tmp_path / "needle.json").read_text())) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "missing.yaml"], r"config file .*missing\.yaml does not exist"),
        (["data.tokenizer=byte"], r"data.tokenizer='byte' has 259 tokens but model.vocab_size=128"),
        (
            ["--config", str(REPO / "configs" / "tiny.yaml")],
            r"parameters in .*out/model do not fit the configured model",
        ),
    ],
)
def test_bad_input_is_named(imported, args, message, capsys):
    assert evaluate_main([str(imported / "out"), *GRID, f"data.source={imported / 'text.txt'}", *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_parameters_without_a_config_ask_for_one(imported, tmp_path, capsys):
    (tmp_path / "model").mkdir()
    assert evaluate_main([str(tmp_path), *GRID]) == 2
    assert (
        f"{tmp_path} holds parameters but no model.yaml: name their run config with --config" in capsys.readouterr().err
    )


def test_no_samples_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        evaluate_main([str(tmp_path), "--samples", "0"])
    assert "--samples 0: give at least 1 haystack per grid point" in capsys.readouterr().err


def test_a_run_without_a_checkpoint_is_named_before_its_data_is_read(tmp_path, capsys):
    config = to_dict(load_config(REPO / "configs" / "tiny.yaml"))  # as a run writes it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    assert evaluate_main([str(tmp_path), *GRID, f"data.source={tmp_path / 'missing.txt'}"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'checkpoints'} holds no checkpoint: neither a `model` item nor checkpoint step "
        "directories (it does not exist)\n"
    )
