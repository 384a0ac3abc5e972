"""Document sources, held-out split, packing invariants, determinism and exact resume."""

import json
import pickle
import re
import tracemalloc

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from train.config import DataConfig
from train.data.files import TextFiles
from train.data.held_out import split_indices
from train.data.packing import pack
from train.data.pipeline import build_dataset, upsample
from train.data.sources import open_source, stdlib_source
from train.data.tokenizer import ByteTokenizer
from train.errors import DataError

TOK = ByteTokenizer()
SEQ_LEN = 16
# Lengths chosen to hit: shorter than a row, exactly a row, several rows, a single byte.
DOCS = [f"doc{i}:" + "abcdefghijklmnopqrstuvwxyz"[: (7 * i) % 27] * (1 + i % 3) for i in range(12)] + ["x"]


@pytest.fixture
def corpus(tmp_path):
    """A folder with one text file per document, named so sorting keeps DOCS order."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, doc in enumerate(DOCS):
        (folder / f"{i:02d}.txt").write_text(doc)
    return folder


def config(source, **overrides) -> DataConfig:
    defaults = dict(source=str(source), seq_len=SEQ_LEN, eval_fraction=0.0, shuffle=False)
    return DataConfig(**{**defaults, **overrides})


def documents(texts):
    """(inputs, targets) int32 per document, as the pipeline builds them: [bos] + bytes + [eos]."""
    out = []
    for text in texts:
        ids = np.array([TOK.bos_id, *text.encode(), TOK.eos_id], np.int32)
        out.append((ids[:-1], ids[1:]))
    return out


def take(dataset, n):
    it = iter(dataset)
    return [next(it) for _ in range(n)]


def rows(batches):
    """Every row of every batch: dicts of [seq_len] arrays."""
    return [{k: v[r] for k, v in batch.items()} for batch in batches for r in range(len(batch["tokens"]))]


def segments(row):
    """(tokens, targets, positions) of each segment of a row, in order."""
    ids = row["segment_ids"]
    return [
        (row["tokens"][ids == s], row["targets"][ids == s], row["positions"][ids == s]) for s in np.unique(ids[ids > 0])
    ]


# ---------------------------------------------------------------- sources


def test_text_file_is_one_document(tmp_path):
    path = tmp_path / "book.txt"
    text = "héllo\nworld\n" * 1000  # past the head read to tell text from binary: stray bytes there are replaced
    path.write_bytes(text.encode() + b"\xff")
    source = open_source(config(path))
    assert len(source) == 1 and source[0] == text + "\ufffd"


@pytest.mark.parametrize(
    "text",
    [
        "".join(f"line {i} é 漢字\n" for i in range(3000)),  # cut after a newline
        " ".join(f"word{i}é" for i in range(6000)),  # one line: cut before a word
        "é漢" * 8000,  # no space: cut before a character
    ],
)
def test_a_large_text_file_is_one_document_read_in_pieces_that_split_no_line_word_or_character(tmp_path, text):
    path = tmp_path / "book.txt"
    path.write_text(text)
    source = TextFiles([path])
    pieces, start = [], 0
    while start is not None:
        piece, start = source.read(0, start, None, 4096)
        pieces.append(piece)
    assert len(source) == 1 and source.sizes().tolist() == [len(text.encode())]
    assert len(pieces) >= len(text.encode()) // 4096 and "".join(pieces) == text
    assert all(piece.endswith(("\n", "é", "漢")) for piece in pieces)


def test_one_large_text_file_is_read_in_bounded_memory(tmp_path):
    """Held whole with its token arrays, a 20 MB one-line file took 470 MiB here; read a piece at a time, the
    pipeline holds a few pieces whatever the file's size."""
    path = tmp_path / "one-line.txt"
    path.write_text(" ".join(["abcdefghi"] * 2_000_000))
    tracemalloc.start()  # before the pipeline exists: opening and indexing the file count too
    batches = iter(build_dataset(config(path, eval_fraction=0.02, shuffle=True), TOK, batch_size=8))
    for _ in range(4):
        next(batches)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    batches.close()
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MiB"  # 470 MiB when the file is read whole


def test_folder_with_pattern_is_recursive_sorted_and_skips_hidden(tmp_path):
    for name, text in [("b.txt", "B"), ("sub/a.txt", "A"), ("c.md", "C"), (".hidden.txt", "H"), (".git/x.txt", "G")]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    source = open_source(config(tmp_path, file_pattern="*.txt"))
    assert [source[i] for i in range(len(source))] == ["B", "A"]
    assert len(open_source(config(tmp_path))) == 3


def test_jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [
        json.dumps({"text": "first", "id": 1}),
        "",
        json.dumps({"text": "ünï ✓"}),
        " \r",
        json.dumps({"text": "last"}),
    ]
    path.write_text("\r\n".join(lines))  # CRLF, blank lines, no trailing newline
    source = open_source(config(path))
    assert [source[i] for i in range(len(source))] == ["first", "ünï ✓", "last"]
    assert pickle.loads(pickle.dumps(source))[2] == "last"


def test_jsonl_missing_field_names_file_line_field_and_keys(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"content": "no", "id": 2}) + "\n")
    with pytest.raises(
        DataError, match=re.escape(f"{path}:2: no field 'text' (data.text_field); keys present: ['content', 'id']")
    ):
        open_source(config(path))


def test_parquet_reads_rows_across_row_groups(tmp_path):
    path = tmp_path / "docs.parquet"
    texts = [f"row {i} ✓" for i in range(7)]
    pq.write_table(pa.table({"id": list(range(7)), "body": texts}), path, row_group_size=3)
    source = open_source(config(path, text_field="body"))
    assert len(source) == 7
    assert [source[i] for i in (6, 0, 3, 4, 1)] == [texts[i] for i in (6, 0, 3, 4, 1)]
    assert pickle.loads(pickle.dumps(source))[5] == texts[5]


def test_every_source_knows_its_document_sizes_without_reading_them(corpus, tmp_path):
    assert open_source(config(corpus)).sizes().tolist() == [len(doc.encode()) for doc in DOCS]
    assert open_source(config(corpus, max_documents=3)).sizes().tolist() == [len(doc.encode()) for doc in DOCS[:3]]
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": text}) for text in ("a", "bbbb")]
    jsonl.write_text("\n".join(lines) + "\n")
    assert open_source(config(jsonl)).sizes().tolist() == [len(line) + 1 for line in lines]
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["ab", "✓", "abcdef"]}), parquet, row_group_size=2)
    assert open_source(config(parquet)).sizes().tolist() == [2, 3, 6]


def test_upsampling_repeats_long_documents_by_their_weight():
    indices, long = np.arange(20000), np.arange(20000) % 10 == 0
    repeated = upsample(indices, long, 2.5, seed=0)
    counts = np.bincount(repeated, minlength=len(indices))
    assert set(counts[~long]) == {1} and set(counts[long]) == {2, 3}
    assert abs(counts[long].sum() - 2.5 * long.sum()) < 4 * np.sqrt(0.25 * long.sum())  # within sampling error
    assert np.array_equal(upsample(indices, long, 2.5, seed=0), repeated)
    assert np.array_equal(np.unique(upsample(indices, long, 1.0, seed=0)), indices)


def test_an_upsampled_epoch_holds_each_long_document_weight_times(corpus):
    cfg = config(corpus, long_document_bytes=40, long_document_weight=3.0)
    batches = list(build_dataset(cfg, TOK, batch_size=1, num_epochs=1))
    stream = np.concatenate([row["tokens"][row["segment_ids"] > 0] for row in rows(batches)])
    starts = np.flatnonzero(stream == TOK.bos_id)
    seen = [TOK.decode(doc) for doc in np.split(stream, starts[1:])]
    for doc in DOCS:
        assert sum(text.startswith(doc) for text in seen) == (3 if len(doc) >= 40 else 1), doc
    assert 0 < sum(len(doc) >= 40 for doc in DOCS) < len(DOCS)


def test_parquet_missing_column_lists_columns(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [1], "body": ["x"]}), path)
    with pytest.raises(ValueError, match=r"no column 'text'.*\['id', 'body'\]"):
        open_source(config(path))


def test_stdlib_is_the_default_corpus():
    assert len(stdlib_source()) > 100
    source = open_source(DataConfig(max_documents=5))
    assert len(source) == 5 and source[0]


def test_missing_source_names_path_and_choices(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope.*stdlib"):
        open_source(config(tmp_path / "nope"))


def test_empty_corpus(tmp_path):
    with pytest.raises(ValueError, match=r"empty corpus.*'\*\.txt'"):
        open_source(config(tmp_path, file_pattern="*.txt"))
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        open_source(config(tmp_path, file_pattern="*.txt"))


# ---------------------------------------------------------------- split


def test_split_is_disjoint_covering_and_deterministic():
    train, held = split_indices(100, 0.1, seed=3)
    assert len(held) == 10 and not set(train) & set(held)
    assert sorted([*train, *held]) == list(range(100))
    again = split_indices(100, 0.1, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(held, again[1])
    assert not np.array_equal(held, split_indices(100, 0.1, seed=4)[1])
    assert [len(part) for part in split_indices(2, 0.01, 0)] == [1, 1]
    assert [len(part) for part in split_indices(1, 0.5, 0)] == [1, 0]
    assert [len(part) for part in split_indices(5, 0.0, 0)] == [5, 0]


def test_eval_split_reads_only_held_out_documents_in_order(corpus):
    cfg = config(corpus, eval_fraction=0.25, shuffle=True)
    _, held = split_indices(len(DOCS), 0.25, cfg.seed)
    batches = list(build_dataset(cfg, TOK, batch_size=1, split="eval", num_epochs=1))
    stream = np.concatenate([row["tokens"][row["segment_ids"] > 0] for row in rows(batches)])
    expected = np.concatenate([inputs for inputs, _ in documents([DOCS[i] for i in held])])
    assert np.array_equal(stream, expected)


# ---------------------------------------------------------------- packing


def check_row_invariants(row):
    ids, pos, mask = row["segment_ids"], row["positions"], row["loss_mask"]
    dtypes = {
        "tokens": np.int32,
        "targets": np.int32,
        "segment_ids": np.int32,
        "positions": np.int32,
        "loss_mask": np.float32,
    }
    assert {k: (v.dtype, v.shape) for k, v in row.items()} == {k: (d, (SEQ_LEN,)) for k, d in dtypes.items()}
    for tokens, _, positions in segments(row):  # positions count from the segment's start; a bos only there
        assert np.array_equal(positions, np.arange(len(positions))) and TOK.bos_id not in tokens[1:]
    assert np.array_equal(mask, (ids > 0).astype(np.float32))
    assert np.all(pos[ids == 0] == 0) and np.all(row["tokens"][ids == 0] == TOK.pad_id)
    same = (ids[:-1] == ids[1:]) & (ids[:-1] > 0)
    assert np.array_equal(row["targets"][:-1][same], row["tokens"][1:][same])


def is_piece(tokens, targets, docs, at=None):
    """Whether (tokens, targets) is docs[d][p:p+n] for some document d and offset p (one of `at`, default any)."""
    n = len(tokens)
    return any(
        np.array_equal(inputs[p : p + n], tokens) and np.array_equal(outputs[p : p + n], targets)
        for inputs, outputs in docs
        for p in (range(len(inputs) - n + 1) if at is None else at(len(inputs)))
    )


def test_concat_packing_keeps_the_token_stream(corpus):
    all_rows = rows(build_dataset(config(corpus), TOK, batch_size=1, num_epochs=1))
    docs = documents(DOCS)
    for row in all_rows:
        check_row_invariants(row)
        assert all(is_piece(tokens, targets, docs) for tokens, targets, _ in segments(row))
        assert all(tokens[0] == TOK.bos_id for tokens, _, _ in segments(row)[1:])  # only the first goes on from before
    assert all(row["segment_ids"].min() > 0 for row in all_rows[:-1])  # padding only at the very end
    for field, k in (("tokens", 0), ("targets", 1)):
        stream = np.concatenate([row[field][row["segment_ids"] > 0] for row in all_rows])
        assert np.array_equal(stream, np.concatenate([doc[k] for doc in docs]))


def test_first_fit_packing_places_every_piece_once(corpus):
    all_rows = rows(build_dataset(config(corpus, packing="first_fit"), TOK, batch_size=1, num_epochs=1))
    docs = documents(DOCS)
    found = []
    for row in all_rows:
        check_row_invariants(row)
        for tokens, targets, _ in segments(row):
            assert is_piece(tokens, targets, docs, at=lambda length: range(0, length, SEQ_LEN))
            found.append(tuple(tokens))
    expected = [tuple(inputs[o : o + SEQ_LEN]) for inputs, _ in docs for o in range(0, len(inputs), SEQ_LEN)]
    assert sorted(found) == sorted(expected)
    assert any(row["segment_ids"].max() > 1 for row in all_rows)  # short pieces share rows


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
def test_packer_keeps_inputs_and_targets_in_lockstep(packing):
    lengths = [3, 16, 14, 1, 7, 9, 16, 5]  # chunks of at most seq_len, as train/data/token_stream.py gives them
    examples = [
        {"inputs": ids, "targets": ids + 1, "positions": ids % 100}
        for ids in (np.arange(n, dtype=np.int32) + 100 * i for i, n in enumerate(lengths))
    ]
    source = grain.MapDataset.source(examples).to_iter_dataset()
    out = list(pack(source, seq_len=SEQ_LEN, packing=packing, num_bins=4))
    assert out
    for row in out:
        real = row["segment_ids"] > 0
        assert np.array_equal(row["targets"][real], row["tokens"][real] + 1)
        for segment in np.unique(row["segment_ids"][real]):  # positions from each segment's start
            assert np.array_equal(
                row["positions"][row["segment_ids"] == segment], np.arange(np.sum(row["segment_ids"] == segment))
            )


def test_bad_packing_and_split_are_named(corpus):
    with pytest.raises(ValueError, match=r"'zigzag'.*concat, first_fit"):
        build_dataset(config(corpus, packing="zigzag"), TOK, batch_size=1)
    with pytest.raises(ValueError, match=r"'test'.*train, eval"):
        build_dataset(config(corpus), TOK, batch_size=1, split="test")
    with pytest.raises(DataError, match=r"split='eval' has no documents.*data.eval_fraction > 0"):
        build_dataset(config(corpus), TOK, batch_size=1, split="eval")


# ---------------------------------------------------------------- determinism and resume


def test_same_seed_same_batches_different_seed_different_order(corpus):
    def first(seed):
        return take(build_dataset(config(corpus, shuffle=True, seed=seed), TOK, batch_size=2), 6)

    a, b, c = first(0), first(0), first(1)
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)
    assert not all(np.array_equal(x["tokens"], z["tokens"]) for x, z in zip(a, c, strict=True))


def test_epochs_are_reshuffled(corpus):
    cfg = config(corpus, shuffle=True)
    batches = list(build_dataset(cfg, TOK, batch_size=1, num_epochs=2))
    stream = np.concatenate([row["tokens"][row["segment_ids"] > 0] for row in rows(batches)])
    starts = np.flatnonzero(stream == TOK.bos_id)
    order = [TOK.decode(doc) for doc in np.split(stream, starts[1:])]
    first, second = order[: len(DOCS)], order[len(DOCS) :]
    assert sorted(first) == sorted(second) == sorted(DOCS)
    assert first != second


@pytest.mark.parametrize("packing", ["concat", "first_fit"])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_exact_resume_from_json_state(corpus, packing, k):
    upsampling = dict(long_document_bytes=30, long_document_weight=2.5) if packing == "concat" else {}
    cfg = config(corpus, shuffle=True, packing=packing, eval_fraction=0.1, **upsampling)
    it = iter(build_dataset(cfg, TOK, batch_size=2))
    for _ in range(k):
        next(it)
    saved = json.dumps(it.get_state())
    expected = [next(it) for _ in range(7)]

    resumed = iter(build_dataset(cfg, TOK, batch_size=2))
    resumed.set_state(json.loads(saved))
    got = [next(resumed) for _ in range(7)]
    for x, y in zip(expected, got, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key])
