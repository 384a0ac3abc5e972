"""Bad data is found when the source is indexed, before training, and stops with a DataError naming the file
(and line); binary files in a folder are skipped with a logged count; a single text file holds out its tail."""

import errno
import json
import logging
import os
import pickle
import re

import numpy as np
import pytest

from train.config import DataConfig
from train.data import cuts, files
from train.data.files import SNIFF_BYTES
from train.data.pipeline import build_dataset
from train.data.sources import open_source
from train.data.tokenizer import ByteTokenizer
from train.errors import DataError

TOK = ByteTokenizer()


def config(source, **overrides) -> DataConfig:
    defaults = dict(source=str(source), seq_len=16, eval_fraction=0.0, shuffle=False)
    return DataConfig(**{**defaults, **overrides})


def text_stream(dataset) -> str:
    """The text of every real token of every batch, bos/eos dropped."""
    ids = np.concatenate([batch["tokens"][batch["segment_ids"] > 0] for batch in dataset])
    return TOK.decode(ids[ids < 256])


@pytest.fixture
def unreadable(monkeypatch):
    """unreadable(path) makes a file or folder unreadable: chmod 0, or where that does not bind (root) opening or
    listing it fails with the same PermissionError."""
    denied, changed = set(), []

    def failing(real):
        def call(path, *args, **kwargs):
            if str(path) in denied:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real(path, *args, **kwargs)

        return call

    if os.geteuid() == 0:
        monkeypatch.setattr(files, "open", failing(open), raising=False)
        monkeypatch.setattr(os, "scandir", failing(os.scandir))

    def make(path):
        if os.geteuid() == 0:
            denied.add(str(path))
        else:
            path.chmod(0)
            changed.append(path)

    yield make
    for path in changed:
        path.chmod(0o755)


# ---------------------------------------------------------------- JSON lines


def test_jsonl_malformed_line_is_found_when_indexed_with_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": f"document {i}"}) for i in range(300)]
    lines[200] = '{"text": "a" "b"}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        DataError, match=re.escape(f"{path}:201: not valid JSON (Expecting ',' delimiter at column 14)")
    ):
        open_source(config(path))


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (b"[1, 2]", "a JSON array; each line must be a JSON object with a string field 'text' (data.text_field)"),
        (b'{"text": 3}', "field 'text' is a JSON number; each line must be"),
        (b'{"text": null}', "field 'text' is a JSON null"),
        (b'{"body": "x"}', "no field 'text' (data.text_field); keys present: ['body']"),
    ],
)
def test_jsonl_bad_line_names_file_line_and_what_is_wrong(tmp_path, line, problem):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "ok"}\n\n' + line + b"\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:3: {problem}")):
        open_source(config(path))


def test_stray_invalid_utf8_reads_as_u_fffd_in_every_kind_of_file_and_is_named_once(tmp_path, caplog):
    """A text file's stray byte in its head or past it, a JSON line's, short or read in pieces: each reads as U+FFFD,
    and the first of each file is logged naming it (a JSON line's by line)."""
    text = "x" * 100 + "\xff" + "y" * 20_000 + "\xfe" + "z"
    stray = text.encode("latin-1")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_bytes(stray)
    jsonl = tmp_path / "a.jsonl"
    long = b"w" * (cuts.PIECE_BYTES + 10) + b"\xff"
    jsonl.write_bytes(b'{"text": "ok"}\n{"text": "' + stray + b'"}\n{"text": "' + long + b'"}\n')
    replaced = text.replace("\xff", "\ufffd").replace("\xfe", "\ufffd")
    with caplog.at_level(logging.WARNING):
        folder = open_source(config(tmp_path / "folder"))
        assert folder[0] == replaced and read_whole(folder, 0) == replaced
        lines = open_source(config(jsonl))
        assert lines[1] == replaced and read_whole(lines, 2) == "w" * (cuts.PIECE_BYTES + 10) + "\ufffd"
    warnings = [r.getMessage() for r in caplog.records if "invalid UTF-8" in r.getMessage()]
    assert warnings == [
        f"{tmp_path / 'folder' / 'a.txt'}: invalid UTF-8 (byte 0xff) read as U+FFFD; later ones in this file are "
        "replaced without a word",
        f"{jsonl}:2: invalid UTF-8 (byte 0xff) read as U+FFFD; later ones in this file are replaced without a word",
    ]


def read_whole(source, index: int) -> str:
    """Document `index` read a piece at a time."""
    pieces, start = [], 0
    while start is not None:
        piece, start = source.read(index, start, None, 4096)
        pieces.append(piece)
    return "".join(pieces)


def test_jsonl_index_holds_offsets_not_text(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i}" * 100_000}) + "\n" for i in range(10)))
    source = open_source(config(path))
    assert len(source) == 10 and source[7] == "7" * 100_000
    assert len(pickle.dumps(source)) < 2_000


# ---------------------------------------------------------------- text folders


def test_binary_and_non_utf8_files_in_a_folder_are_skipped_with_a_logged_count(tmp_path, caplog):
    (tmp_path / "a.txt").write_text("plain")
    (tmp_path / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "c.txt").write_bytes("café".encode("latin-1"))
    straddling = "x" * (SNIFF_BYTES - 1) + "✓"  # a character cut by the head read is still text
    (tmp_path / "d.txt").write_text(straddling)
    source = open_source(config(tmp_path))
    assert [source[i] for i in range(len(source))] == ["plain", straddling]
    example = f"{tmp_path / 'b.png'}: NUL byte at offset 8"
    assert f"skipped 2 of 4 files that are not UTF-8 text (binary or another encoding), e.g. {example}" in caplog.text


def test_a_folder_of_binary_files_is_an_empty_corpus_saying_why(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(
        DataError, match=r"empty corpus: .* has no documents \(skipped 1 of 1 files .*NUL byte at offset 0"
    ):
        open_source(config(tmp_path))


def test_unreadable_file_is_named_when_indexed(tmp_path, unreadable):
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_text("locked")
    unreadable(tmp_path / "b.txt")
    with pytest.raises(DataError, match=re.escape(f"cannot read {tmp_path / 'b.txt'}: Permission denied")):
        open_source(config(tmp_path))


def test_unreadable_subfolder_is_named_not_skipped(tmp_path, unreadable):
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("hidden behind permissions")
    unreadable(tmp_path / "sub")
    with pytest.raises(DataError, match=re.escape(f"cannot read folder {tmp_path / 'sub'}: Permission denied")):
        open_source(config(tmp_path))


def test_unreadable_jsonl_is_named_when_indexed(tmp_path, unreadable):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "x"}))
    unreadable(path)
    with pytest.raises(DataError, match=re.escape(f"cannot read {path}: Permission denied")):
        open_source(config(path))


def test_not_parquet_is_named(tmp_path):
    path = tmp_path / "a.parquet"
    path.write_text("not parquet")
    with pytest.raises(DataError, match=re.escape(f"cannot read {path} as Parquet: ")):
        open_source(config(path))


# ---------------------------------------------------------------- files that go away while training


def test_file_gone_at_read_time_is_a_data_error_naming_it(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(name * 20)
    dataset = build_dataset(config(tmp_path), TOK, batch_size=1)
    (tmp_path / "b.txt").unlink()
    with pytest.raises(DataError, match=re.escape(f"cannot read {tmp_path / 'b.txt'}: No such file or directory")):
        for _ in zip(range(100), dataset, strict=False):
            pass


def test_jsonl_gone_at_read_time_is_a_data_error_naming_it(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "x"}))
    source = open_source(config(path))
    path.unlink()
    with pytest.raises(DataError, match=re.escape(f"cannot read {path}: No such file or directory")):
        source[0]


# ---------------------------------------------------------------- a single text file


def test_single_text_file_holds_out_its_tail_for_eval(tmp_path):
    path = tmp_path / "one.txt"
    text = "".join(f"line {i}\n" for i in range(100))  # 790 characters
    path.write_text(text)
    cfg = config(path, eval_fraction=0.1)
    source = open_source(cfg)  # shared by both splits, as a run does
    train = build_dataset(cfg, TOK, batch_size=2, split="train", num_epochs=1, source=source)
    held = build_dataset(cfg, TOK, batch_size=1, split="eval", num_epochs=1, source=source)
    cut = len(text) - 79
    assert text_stream(train) == text[:cut][: len(text_stream(train))]  # the last incomplete batch is dropped
    assert text_stream(held) == text[cut:]
    endless = iter(build_dataset(cfg, TOK, batch_size=4, split="eval", source=source))  # as evaluation reads it
    assert all(next(endless)["loss_mask"].all() for _ in range(3))


def test_single_text_file_without_eval_fraction_trains_on_all_of_it(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("abcdefghij" * 10)
    stream = text_stream(build_dataset(config(path), TOK, batch_size=1, num_epochs=1))
    assert stream == "abcdefghij" * 10
    with pytest.raises(DataError, match="split='eval' has no documents"):
        build_dataset(config(path), TOK, batch_size=1, split="eval")
