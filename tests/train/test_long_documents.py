"""Long documents: one segment across the rows they span (bos and eos only at their real ends, no false boundary within
a row), eval_fraction of their bytes held out however few they are, read in memory that does not grow with them, and
resumed exactly from the middle of one."""

import json
import random
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from train.config import DataConfig
from train.data import held_out
from train.data.files import JsonlFile
from train.data.pipeline import build_dataset
from train.data.sources import open_source
from train.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
MB = 10**6


def config(source, **overrides) -> DataConfig:
    defaults = dict(source=str(source), seq_len=1 << 16, eval_fraction=0.0, shuffle=False)
    return DataConfig(**{**defaults, **overrides})


def book(size: int, seed: int = 0) -> str:
    """`size` bytes of numbered ASCII lines, each different."""
    return "".join(f"line {i} of book {seed}: some words\n" for i in range(size // 30 + 1))[:size]


def write(tmp_path, text: str, kind: str):
    """`text` as one document: a text file, one JSONL line or one Parquet row."""
    path = tmp_path / f"one.{kind}"
    if kind == "txt":
        path.write_text(text)
    elif kind == "jsonl":
        path.write_text(json.dumps({"id": 7, "text": text}) + "\n")
    else:
        pq.write_table(pa.table({"text": [text]}), path)
    return path


def stream(dataset, field: str = "tokens") -> np.ndarray:
    """`field` at the real tokens of every row of every batch, in order."""
    return np.concatenate([batch[field][batch["segment_ids"] > 0] for batch in dataset])


def text_of(ids: np.ndarray) -> str:
    """The text of byte tokens `ids`, bos and eos left out."""
    return ids[ids < 256].astype(np.uint8).tobytes().decode()


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_one_document_of_several_mb_holds_out_eval_fraction_of_its_text(tmp_path, kind):
    text = book(3 * MB)
    cfg = config(write(tmp_path, text, kind), eval_fraction=0.02)
    source = open_source(cfg)
    train, held = (
        list(build_dataset(cfg, TOK, batch_size=1, split=split, num_epochs=1, source=source))
        for split in ("train", "eval")
    )
    head, tail = text_of(stream(train)), text_of(stream(held))
    assert text.startswith(head) and text.endswith(tail) and len(head) + 1 + len(tail) == len(text)  # the head's
    assert len(tail) / len(text) == pytest.approx(0.02, abs=0.001)  # last byte is a target only: then the tail
    assert stream(train)[0] == TOK.bos_id and stream(train)[1:].max() < 256 and stream(train, "targets").max() < 256
    assert stream(held).max() < 256 and stream(held, "targets")[-1] == TOK.eos_id  # a tail: no bos, the eos


def test_a_folder_of_1_1_and_3_mb_files_holds_out_eval_fraction_of_its_text(tmp_path):
    texts = [book(size, seed) for seed, size in enumerate((MB, MB, 3 * MB))]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    cfg = config(tmp_path, eval_fraction=0.02)
    held = text_of(stream(build_dataset(cfg, TOK, batch_size=1, split="eval", num_epochs=1)))
    assert held == "".join(text[len(text) - round(len(text) * 0.02) :] for text in texts)
    assert len(held) / sum(map(len, texts)) == pytest.approx(0.02, abs=0.0005)


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_a_long_document_is_one_segment_across_its_rows(tmp_path, kind, packing):
    """2.5 MB is read in three pieces of about a MiB, none of them a row's length: no bos, eos, new segment or
    position jump where one piece meets the next; each row's positions from 0 (train/data/packing.py says why)."""
    text = book(2_500_000)
    cfg = config(write(tmp_path, text, kind), packing=packing)
    batches = list(build_dataset(cfg, TOK, batch_size=1, num_epochs=1))
    ids = np.concatenate([[TOK.bos_id], np.frombuffer(text.encode(), np.uint8), [TOK.eos_id]]).astype(np.int32)
    rows = len(batches)
    assert rows == -(-(len(ids) - 1) // cfg.seq_len)
    for r, batch in enumerate(batches):
        real = batch["segment_ids"][0] > 0
        length = int(real.sum())
        assert np.all(batch["segment_ids"][0][real] == 1) and (r == rows - 1 or length == cfg.seq_len)
        start = r * cfg.seq_len
        assert np.array_equal(batch["positions"][0][:length], np.arange(length))  # each row's from 0: see packing.py
        assert np.array_equal(batch["tokens"][0][:length], ids[start : start + length])
        assert np.array_equal(batch["targets"][0][:length], ids[start + 1 : start + length + 1])


def peak_memory(path, batches: int) -> int:
    """Peak bytes Python allocates while the pipeline gives its first `batches` batches (the source indexed and
    split beforehand)."""
    cfg = config(path, seq_len=4096, eval_fraction=0.02)
    dataset = build_dataset(cfg, TOK, batch_size=4, source=open_source(cfg))
    tracemalloc.start()
    iterator = iter(dataset)
    for _ in range(batches):
        next(iterator)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    iterator.close()
    return peak


def test_memory_does_not_grow_with_a_documents_size(tmp_path):
    """A whole tokenized document took 8 bytes a token here, for every copy read ahead (the 16 MB line: 2 GiB)."""
    small, large = tmp_path / "small", tmp_path / "large"
    small.mkdir()
    large.mkdir()
    peaks = [
        peak_memory(write(folder, book(size * MB), "jsonl"), batches=3) for folder, size in ((small, 2), (large, 16))
    ]
    assert peaks[1] < 1.25 * peaks[0] + 2**20 and peaks[1] < 64 * 2**20, [f"{p / 2**20:.0f} MiB" for p in peaks]


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_a_jsonl_text_is_read_in_pieces_whatever_its_escapes(tmp_path, ensure_ascii):
    """Pieces are cut in the JSON string as stored: never inside an escape, a character or a surrogate pair."""
    rng = random.Random(0)
    characters = ["ab", " ", "\n", '"', "\\", "\t", "é", "漢", "😀", "\u2028", "/"]
    text = "".join(rng.choice(characters) for _ in range(3000))
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"meta": {"text": "not this"}, "text": text}, ensure_ascii=ensure_ascii) + "\n")
    source = JsonlFile(path, "text")
    for size in (1, 7, 100):
        pieces, start = [], 0
        while start is not None:
            piece, start = source.read(0, start, None, size)
            pieces.append(piece)
        assert "".join(pieces) == text and len(pieces) > len(text) // (20 * size)
    cut = source.tail_start(0, 0.3)
    head, tail = source.read(0, 0, cut, 10**9), source.read(0, cut, None, 10**9)
    assert head[0] + tail[0] == text and head[1] is tail[1] is None


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
@pytest.mark.parametrize("k", [1, 9, 40])
def test_exact_resume_in_the_middle_of_a_long_document(tmp_path, monkeypatch, packing, k):
    monkeypatch.setattr(held_out, "PIECE_BYTES", 1000)  # pieces of about 1000 bytes: a resume lands inside one
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps({"text": book(20_000, seed)}) + "\n" for seed in range(2)))
    cfg = config(path, seq_len=64, eval_fraction=0.1, packing=packing, shuffle=True)
    iterator = iter(build_dataset(cfg, TOK, batch_size=2))
    for _ in range(k):
        next(iterator)
    saved = json.dumps(iterator.get_state())
    expected = [next(iterator) for _ in range(20)]
    resumed = iter(build_dataset(cfg, TOK, batch_size=2))
    resumed.set_state(json.loads(saved))
    for x, y in zip(expected, [next(resumed) for _ in range(20)], strict=True):
        assert all(np.array_equal(x[key], y[key]) for key in x)
    assert any(batch["tokens"][r][0] != TOK.bos_id for batch in expected for r in range(2))  # inside a document
