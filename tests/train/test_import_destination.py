"""`python -m train.hf import HF_DIR OUT` writes OUT whole and swaps it in: an OUT that holds anything (another
import, the same import made before, other files) is refused in one line unless --overwrite, which replaces the whole
set, so no file of an earlier import (its tokenizer.json) outlives it into a run or an export."""

import dataclasses
import os
import pathlib

import pytest
import yaml
from flax import nnx

import models
from models.hf import save_pretrained
from tests.tiny_models import TINY_LLAMA
from train import hf as cli
from train.config.imported import import_layer


def hf_dir(path: pathlib.Path, embed_dim: int, tokenizer: bool) -> pathlib.Path:
    """A Hugging Face directory of a tiny random Llama `embed_dim` wide, with a tokenizer.json when `tokenizer`."""
    config = dataclasses.replace(TINY_LLAMA, embed_dim=embed_dim)
    save_pretrained(models.build(config, rngs=nnx.Rngs(0)), path)
    if tokenizer:
        (path / "tokenizer.json").write_text('{"model": "the old one"}')
    return path


def error_line(capsys) -> str:
    error = capsys.readouterr().err
    assert error.count("\n") == 1, error
    return error.strip()


def embed_dim(out: pathlib.Path) -> int:
    return yaml.safe_load((out / "model.yaml").read_text())["model"]["embed_dim"]


def test_an_earlier_import_is_refused_unless_overwrite_which_replaces_the_whole_set(tmp_path, capsys):
    old, new = hf_dir(tmp_path / "old", 32, tokenizer=True), hf_dir(tmp_path / "new", 64, tokenizer=False)
    out = tmp_path / "imported"
    assert cli.main(["import", str(old), str(out)]) == 0
    capsys.readouterr()
    for source in (new, old):  # another import, and the very same one again
        assert cli.main(["import", str(source), str(out)]) == 2
        assert error_line(capsys) == (
            f"error: not importing into {out}: it holds an import (hf_config.json, model, model.yaml, tokenizer.json). "
            "Choose an empty or new directory, or pass --overwrite to replace everything in it"
        )
    assert embed_dim(out) == 32 and (out / "tokenizer.json").is_file()
    assert cli.main(["import", str(new), str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["hf_config.json", "model", "model.yaml"]
    assert embed_dim(out) == 64 and "data" not in import_layer(str(out))  # no tokenizer for a run config
    assert cli.main(["export", str(out), str(tmp_path / "exported")]) == 0
    assert sorted(os.listdir(tmp_path / "exported")) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["exported", "imported", "new", "old"]  # no staging directory left


@pytest.mark.parametrize("before", ["missing", "empty"])
def test_a_new_or_empty_destination_is_taken(tmp_path, before):
    source, out = hf_dir(tmp_path / "hf", 32, tokenizer=True), tmp_path / "a" / "imported"
    if before == "empty":
        out.mkdir(parents=True)
    assert cli.main(["import", str(source), str(out)]) == 0
    assert sorted(os.listdir(out)) == ["hf_config.json", "model", "model.yaml", "tokenizer.json"]


@pytest.mark.parametrize(
    "before, reason",
    [
        (
            "other files",
            "it holds files an import does not write (notes.txt). Choose an empty or new directory, or pass "
            "--overwrite to replace everything in it",
        ),
        ("a file", "it is a file; choose a directory"),
        ("the source", "it holds {source}, the directory imported; choose another directory"),
    ],
    ids=["other-files", "a-file", "the-source"],
)
def test_a_destination_that_cannot_take_an_import_is_named(tmp_path, capsys, before, reason):
    """Other files go only with --overwrite; a file, or the directory imported (or one above it), never."""
    source = hf_dir(tmp_path / "hf", 32, tokenizer=True)
    out = source if before == "the source" else tmp_path / "imported"
    if before == "other files":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    if before == "a file":
        out.write_text("mine")
    capsys.readouterr()
    assert cli.main(["import", str(source), str(out)]) == 2
    assert error_line(capsys) == f"error: not importing into {out}: {reason.format(source=source)}"
    assert cli.main(["import", str(source), str(out), "--overwrite"]) == (0 if before == "other files" else 2)
    if before == "other files":
        assert "notes.txt" not in os.listdir(out)
