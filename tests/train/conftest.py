"""Fixtures of the train tests: `library_file`, the library log of one test; `tokenizer_json`, a small byte-level BPE
tokenizer.json (vocabulary 320; <pad>, <s>, </s> are ids 0, 1, 2) trained in-process."""

import pathlib

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from train.process import library_log

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "def main(): return 0",
    "packing documents into rows of tokens",
    "ünïcödé text — with symbols ✓",
] * 5


@pytest.fixture
def library_file(tmp_path, monkeypatch) -> pathlib.Path:
    """The library log's file for one test, tmp_path/library.log: what the test leaves there stays out of the error
    lines of the tests after it in this process."""
    path = tmp_path / "library.log"
    monkeypatch.setattr(library_log._log, "path", path)
    monkeypatch.setattr(library_log._log, "written", False)
    return path


@pytest.fixture
def tokenizer_json(tmp_path):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path
