"""data.mixture: components held out on their own, drawn by their share of the bytes, exact resume, config errors."""

import json
import logging

import numpy as np
import pytest

from train.config import Config, ConfigError, DataConfig, MixtureComponent, load_config
from train.data.pipeline import build_dataset, splits
from train.data.sources import Mixture, open_source
from train.data.tokenizer import ByteTokenizer
from train.needle import filler_tokens

TOK = ByteTokenizer()


def folder(path, letter: str, sizes) -> str:
    """A folder of text files, one document of `letter` repeated per size."""
    path.mkdir()
    for i, size in enumerate(sizes):
        (path / f"{i:03d}.txt").write_text(letter * size)
    return str(path)


@pytest.fixture
def mixture(tmp_path):
    """Short 'a' documents (weight 3) and long 'b' documents (weight 1): 75% of the bytes are a's."""
    rng = np.random.default_rng(0)
    short = folder(tmp_path / "short", "a", rng.integers(5, 60, size=120))
    long = folder(tmp_path / "long", "b", rng.integers(100, 400, size=40))
    return DataConfig(
        seq_len=64,
        eval_fraction=0.1,
        mixture=(MixtureComponent(short, weight=3.0), MixtureComponent(long, weight=1.0)),
    )


def share_of_a(batches) -> float:
    tokens = np.concatenate([batch["tokens"].ravel() for batch in batches])
    a, b = np.sum(tokens == ord("a")), np.sum(tokens == ord("b"))
    return a / (a + b)


def take(dataset, n):
    it = iter(dataset)
    return [next(it) for _ in range(n)]


def test_each_component_gets_its_weight_of_the_bytes_in_train_and_eval(mixture, caplog):
    with caplog.at_level(logging.INFO, logger="train.data.pipeline"):
        train = take(build_dataset(mixture, TOK, batch_size=8), 150)
    assert share_of_a(train) == pytest.approx(0.75, abs=0.03)
    assert "75.0% of the bytes" in caplog.text and "25.0% of the bytes" in caplog.text
    assert share_of_a(take(build_dataset(mixture, TOK, batch_size=8, split="eval"), 30)) == pytest.approx(0.75, abs=0.1)
    alone = DataConfig(**{**vars(mixture), "mixture": (mixture.mixture[0],)})
    assert share_of_a(take(build_dataset(alone, TOK, batch_size=8), 5)) == 1.0


def test_each_component_is_held_out_on_its_own(mixture):
    source = open_source(mixture)
    assert isinstance(source, Mixture) and source.weights.tolist() == [0.75, 0.25]
    documents, train, held = splits(source, mixture)
    starts = [0, len(source.parts[0])]
    for start, part, train_idx, eval_idx in zip(starts, source.parts, train, held, strict=True):
        assert len(eval_idx) == round(0.1 * len(part))
        assert sorted([*train_idx, *eval_idx]) == list(range(start, start + len(part)))
    held_text = {documents[int(i)] for i in np.concatenate(held)}
    assert {text[0] for text in held_text} == {"a", "b"}
    filler = TOK.decode(filler_tokens(Config(data=mixture), TOK, 10**6, source))
    assert filler.count("a") == sum(len(t) for t in held_text if t[0] == "a") and "b" in filler


def test_long_documents_are_upsampled_within_their_component(mixture, caplog):
    upsampled = DataConfig(**{**vars(mixture), "long_document_bytes": 200, "long_document_weight": 3.0})
    with caplog.at_level(logging.INFO, logger="train.data.pipeline"):
        batches = take(build_dataset(upsampled, TOK, batch_size=8), 150)
    assert share_of_a(batches) == pytest.approx(0.75, abs=0.03)  # the mix is kept
    assert "long documents" in caplog.text and str(mixture.mixture[1].source) in caplog.text


def test_exact_resume_with_a_mixture(mixture):
    cfg = DataConfig(**{**vars(mixture), "long_document_bytes": 200, "long_document_weight": 2.5})
    it = iter(build_dataset(cfg, TOK, batch_size=2))
    for _ in range(3):
        next(it)
    saved = json.dumps(it.get_state())
    expected = [next(it) for _ in range(5)]
    resumed = iter(build_dataset(cfg, TOK, batch_size=2))
    resumed.set_state(json.loads(saved))
    for x, y in zip(expected, [next(resumed) for _ in range(5)], strict=True):
        assert all(np.array_equal(x[key], y[key]) for key in x)


def test_mixture_from_yaml_takes_the_data_fields_it_leaves_unset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data:\n  text_field: body\n  mixture:\n    - {source: a.jsonl, weight: 2}\n"
        "    - {source: b.parquet, text_field: content}\n"
    )
    config = load_config(path)
    assert config.data.mixture == (
        MixtureComponent("a.jsonl", weight=2.0),
        MixtureComponent("b.parquet", text_field="content"),
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.mixture=[{weight: 1}]", r"data.mixture\[0\] needs data.mixture\[0\].source"),
        ("data.mixture=[{source: a, weight: 0}]", r"data.mixture\[0\].weight=0.0 must be a positive number"),
        ("data.mixture=[{source: a, format: csv}]", r"data.mixture\[0\].format='csv' is not allowed; choose one of"),
        ("data.mixture=[{source: a, colour: red}]", r"unknown key 'data.mixture\[0\].colour'"),
        ("data.mixture=[a.jsonl]", r"data.mixture\[0\] must be a mapping"),
    ],
)
def test_bad_mixture_is_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
