"""The record of what a data position depends on (train/data/record.py): growth told from other changes, each named,
and a resume on changed data refused in one line unless data.on_change accepts it."""

import json

import pytest

import train.__main__ as cli
from tests.train.tiny_run import SMALL, TINY, records
from train.config.schema import DataConfig, MixtureComponent
from train.data.record import compare, data_record, resumes_position
from train.data.sources import open_source
from train.data.tokenizer import make_tokenizer
from train.errors import DataError

BYTE = make_tokenizer("byte")
RUN = [*SMALL, "train.steps=2", "train.eval_batches=0", "train.sample_tokens=0", "data.max_documents=0"]


def record(source: str, tokenizer=BYTE, **data) -> dict:
    return data_record(open_source(DataConfig(source=source, **data)), tokenizer)


def lines(count: int, start: int = 0) -> str:
    return "".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(start, start + count))


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(3):
        (root / f"{i}.txt").write_text(f"text file {i} " * 2000)  # longer than both fingerprinted ends
    return root


def test_the_same_data_has_the_same_record(folder):
    assert not compare(record(str(folder)), record(str(folder)))


def test_files_added_or_appended_to_are_growth(folder, tmp_path):
    saved = record(str(folder))
    (folder / "3.txt").write_text("a new file")
    with open(folder / "1.txt", "a") as f:
        f.write("more text")
    changes = compare(saved, record(str(folder)))
    assert changes.other == []
    assert changes.grown == [
        f"1 file added (e.g. {folder / '3.txt'})",
        f"1 file appended to (e.g. {folder / '1.txt'}), 24000 -> 24009 bytes",
        "documents: 3 -> 4",
    ]


def test_removed_shortened_and_rewritten_files_are_other_changes(folder):
    saved = record(str(folder))
    (folder / "0.txt").unlink()
    (folder / "1.txt").write_text("text file 1 " * 1000)
    text = (folder / "2.txt").read_text()
    (folder / "2.txt").write_text(text[:12000] + "X" + text[12001:])  # same size, a byte changed between the ends
    changes = compare(saved, record(str(folder)))
    assert changes.other == [
        f"1 file removed (e.g. {folder / '0.txt'})",
        f"1 file changed (e.g. {folder / '1.txt'}), 24000 -> 12000 bytes, other bytes",
        "documents: 3 -> 2",
    ]
    # a byte between the fingerprinted ends of a file of the same size is not seen: the record is cheap, not a checksum
    assert (folder / "2.txt").stat().st_size == 24000


def test_a_file_that_grew_but_whose_old_bytes_changed_is_not_growth(folder):
    saved = record(str(folder))
    (folder / "0.txt").write_text("another beginning " + "text file 0 " * 2000)
    changes = compare(saved, record(str(folder)))
    assert changes.grown == [] and changes.other[0].startswith(f"1 file changed (e.g. {folder / '0.txt'}), 24000 ->")


def test_lines_appended_to_a_jsonl_source_are_growth(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(lines(20))
    saved = record(str(path))
    with open(path, "a") as f:
        f.write(lines(5, start=20))
    changes = compare(saved, record(str(path)))
    assert changes.other == [] and changes.grown[-1] == "documents: 20 -> 25"


def test_a_tokenizer_regenerated_in_place_is_a_change(tmp_path, folder, tokenizer_json):
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(tokenizer_json.read_bytes())
    saved = record(str(folder), make_tokenizer(str(copy)))
    assert not compare(saved, record(str(folder), make_tokenizer(str(copy))))
    spec = json.loads(copy.read_text())
    spec["model"]["vocab"]["zzz-new-token"] = max(spec["model"]["vocab"].values()) + 1
    copy.write_text(json.dumps(spec))
    changes = compare(saved, record(str(folder), make_tokenizer(str(copy))))
    assert changes.grown == [] and [c.split(":")[0] for c in changes.other] == ["the tokenizer"]


def test_a_mixture_records_every_component(tmp_path, folder):
    path = tmp_path / "corpus.jsonl"
    path.write_text(lines(10))
    mixture = ({"source": str(folder)}, {"source": str(path), "weight": 2.0})
    components = tuple(MixtureComponent(**component) for component in mixture)
    saved = record(str(folder), mixture=components)
    assert sorted(saved["files"]) == sorted([str(path), *(str(folder / f"{i}.txt") for i in range(3))])
    path.write_text(lines(10, start=1))
    assert compare(saved, record(str(folder), mixture=components)).other[0].startswith(f"1 file changed (e.g. {path})")


def test_synthetic_sources_record_no_files():
    saved = record("retrieval", seq_len=128)
    assert saved["files"] == {} and not compare(saved, record("retrieval", seq_len=128))


@pytest.mark.parametrize("on_change", ["refuse", "grown", "restart"])
def test_which_changes_each_setting_accepts(folder, on_change):
    saved = record(str(folder))
    assert resumes_position(saved, saved, on_change, "checkpoint step 4")
    assert resumes_position(None, saved, on_change, "checkpoint step 4")  # saved before records were kept
    (folder / "3.txt").write_text("a new file")
    grown = record(str(folder))
    (folder / "0.txt").unlink()
    shrunk = record(str(folder))
    for now, accepted in ((grown, on_change != "refuse"), (shrunk, on_change == "restart")):
        if accepted:
            assert resumes_position(saved, now, on_change, "checkpoint step 4") is False
            continue
        with pytest.raises(DataError) as refused:
            resumes_position(saved, now, on_change, "checkpoint step 4")
        message = str(refused.value)
        assert message.startswith("the data changed since checkpoint step 4 was saved (")
        assert ("data.on_change=grown (or =restart)" in message) == (now is grown)
        assert "\n" not in message


def test_a_resume_on_a_grown_corpus_is_refused_in_one_line_then_taken_by_choice(tmp_path, capfd):
    corpus, output = tmp_path / "corpus.jsonl", tmp_path / "run"
    corpus.write_text(lines(60))
    argv = [str(TINY), *RUN, f"data.source={corpus}", "checkpoint.every_steps=2", f"train.output_dir={output}"]
    assert cli.main(argv) == 0
    with open(corpus, "a") as f:  # a resume on it crashed in packing, or read a different stream without a word
        f.write(lines(1000, start=60))
    capfd.readouterr()
    assert cli.main([*argv, "train.steps=4"]) == 2
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"the data changed since checkpoint step 2 was saved (1 file appended to (e.g. {corpus})" in errors[0]
    assert "documents: 60 -> 1060): its data position belongs to the data as it was" in errors[0]
    assert "set data.on_change=grown (or =restart) to keep the model, optimizer and step" in errors[0]
    assert [r["step"] for r in records(output)] == [1, 2]

    assert cli.main([*argv, "train.steps=4", "data.on_change=grown"]) == 0
    assert "data.on_change=grown: the model, optimizer and step go on" in capfd.readouterr().err
    assert [r["step"] for r in records(output)] == [1, 2, 3, 4]
    assert cli.main([*argv, "train.steps=6"]) == 0  # step 4 was saved with the grown corpus's record
    assert [r["step"] for r in records(output)] == [1, 2, 3, 4, 5, 6]
