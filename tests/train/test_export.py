"""Export writes a whole Hugging Face set beside its directory and swaps it in: an interruption (an error, a kill, a
full disk) leaves the previous export loadable, and a directory that holds another model is refused unless
--overwrite, which replaces everything in it. A full disk ends the command in one line naming the library log, which
holds the traceback."""

import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx
from safetensors import SafetensorError

import models
import train.__main__ as train_cli
from models.hf import convert, load_pretrained, save_pretrained
from tests.tiny_models import TINY_LLAMA
from tests.train.tiny_run import REPO, SMALL, TINY
from train import hf as cli


def tiny(seed: int, **changes) -> nnx.Module:
    return models.build(dataclasses.replace(TINY_LLAMA, **changes), rngs=nnx.Rngs(seed))


def embedding(path) -> np.ndarray:
    return np.asarray(nnx.state(load_pretrained(path))["embed"]["embedding"][...])


def test_a_failed_save_leaves_the_previous_one(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save_pretrained(tiny(0), out, max_shard_bytes=4000)
    before = sorted(os.listdir(out)), embedding(out)
    (tmp_path / ".out.writing-left-by-a-kill").mkdir()  # an interrupted save's staging directory
    calls = []

    def fail_on_the_third_shard(tensors, file, metadata):
        calls.append(file)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return save_file(tensors, file, metadata=metadata)

    save_file = convert.save_file
    monkeypatch.setattr(convert, "save_file", fail_on_the_third_shard)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(tiny(1), out, max_shard_bytes=4000)
    assert sorted(os.listdir(out)) == before[0]
    np.testing.assert_array_equal(embedding(out), before[1])
    assert sorted(os.listdir(tmp_path)) == ["out"]  # neither staging directory is left
    monkeypatch.undo()
    save_pretrained(tiny(1), out, max_shard_bytes=4000)
    np.testing.assert_array_equal(embedding(out), np.asarray(nnx.state(tiny(1))["embed"]["embedding"][...]))


def test_another_model_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    save_pretrained(tiny(0), out)
    with pytest.raises(ValueError, match=r"describes another model \(hidden_size: 32 there, 64 here"):
        save_pretrained(tiny(0, embed_dim=64), out)
    (out / "generation_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds files a save does not write \(generation_config.json\)"):
        save_pretrained(tiny(0), out)
    save_pretrained(tiny(0, embed_dim=64), out, overwrite=True)
    assert "generation_config.json" not in os.listdir(out)  # the whole set replaced: nothing stale beside it
    assert load_pretrained(out).config.embed_dim == 64


def test_cli_refuses_another_model_in_one_line(tmp_path, capsys):
    save_pretrained(tiny(0), tmp_path / "hf")
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    (tmp_path / "mistral").mkdir()
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        (tmp_path / "mistral" / name).write_text("{}")
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "imported"), str(tmp_path / "mistral")]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "generation_config.json" in error and "--overwrite" in error
    assert cli.main(["export", str(tmp_path / "imported"), str(tmp_path / "mistral"), "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path / "mistral")) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    "failure",
    [
        SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=["safetensors", "os"],
)
def test_a_full_disk_is_one_line_and_leaves_the_previous_export(tmp_path, capsys, monkeypatch, library_file, failure):
    save_pretrained(tiny(0), tmp_path / "hf")
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    out = tmp_path / "out"
    assert cli.main(["export", str(tmp_path / "imported"), str(out)]) == 0
    before = sorted(os.listdir(out)), embedding(out)

    def full(tensors, file, metadata):
        raise failure

    monkeypatch.setattr(convert, "save_file", full)
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "imported"), str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert error.startswith(f"error: writing {out} failed (No space left on device); {out} is left as it was. ")
    assert error.endswith(f" (library messages: {library_file})\n")
    log = library_file.read_text()
    assert "Traceback" in log and f"{type(failure).__name__}: " in log
    assert sorted(os.listdir(out)) == before[0]
    np.testing.assert_array_equal(embedding(out), before[1])
    assert sorted(os.listdir(tmp_path)) == ["hf", "imported", "library.log", "out"]


SLOW_EXPORT = """
import sys, time
from models.hf import convert
from train import hf
save_file = convert.save_file
def slow(tensors, file, metadata):  # a slow disk: the kill lands mid-export
    save_file(tensors, file, metadata=metadata)
    time.sleep(0.5)
convert.save_file = slow
sys.exit(hf.main(sys.argv[1:]))
"""


def test_a_killed_export_leaves_the_previous_one_loadable(tmp_path):
    save_pretrained(tiny(0, num_layers=4), tmp_path / "hf")
    assert cli.main(["import", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    command = ["export", str(tmp_path / "imported"), str(tmp_path / "out"), "--max-shard-bytes", "4000"]
    assert cli.main(command) == 0
    before = embedding(tmp_path / "out")
    process = subprocess.Popen([sys.executable, "-c", SLOW_EXPORT, *command], cwd=REPO)
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob(".out.writing-*/*.partial"))) < 2:
        assert process.poll() is None and time.monotonic() < deadline, "the export ended before two shards"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    np.testing.assert_array_equal(embedding(tmp_path / "out"), before)
    assert cli.main(command) == 0  # and the next export clears what the killed one left
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hf", "imported", "out"]


def test_exported_files_take_the_mode_the_umask_gives(tmp_path):
    """safetensors writes its files 0600; an export's files are as readable as any file the user makes."""
    previous = os.umask(0o022)
    try:
        save_pretrained(tiny(0), tmp_path / "out", max_shard_bytes=4000)
    finally:
        os.umask(previous)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "out").iterdir()}
    assert any(name.endswith(".safetensors") for name in modes) and set(modes.values()) == {0o644}, modes


def test_a_run_from_scratch_exports_its_tokenizer_and_token_ids(tmp_path, tokenizer_json):
    """No import to take them from: the run's own data.tokenizer gives the export its tokenizer.json and its bos /
    eos / pad ids (the byte tokenizer its ids alone)."""
    for name, spec in (("bpe", str(tokenizer_json)), ("byte", "byte")):
        run = tmp_path / name
        overrides = [*SMALL, "train.steps=1", "train.eval_batches=0", "train.sample_tokens=0", "model.vocab_size=320"]
        assert train_cli.main([str(TINY), *overrides, f"data.tokenizer={spec}", f"train.output_dir={run}"]) == 0
        assert cli.main(["export", str(run / "checkpoints"), str(tmp_path / f"{name}-hf")]) == 0
        exported = json.loads((tmp_path / f"{name}-hf" / "config.json").read_text())
        ids = [exported[f"{token}_token_id"] for token in ("bos", "eos", "pad")]
        assert ids == ([1, 2, 0] if name == "bpe" else [257, 258, 256]), exported
        copied = tmp_path / f"{name}-hf" / "tokenizer.json"
        assert copied.is_file() == (name == "bpe")
        if name == "bpe":
            assert copied.read_bytes() == tokenizer_json.read_bytes()


def test_ctrl_c_during_an_export_is_one_line_and_after_it_changes_nothing(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "export_checkpoint", interrupted)
    assert cli.main(["export", str(tmp_path / "in"), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.strip() == (
        f"error: stopped by Ctrl-C before the export finished; {tmp_path / 'out'} is as it was"
    )
    monkeypatch.setattr(cli, "export_checkpoint", lambda *args, **kwargs: (tmp_path / "in", ["model.safetensors"], []))
    # a real Ctrl-C once the export is written, while it reports
    monkeypatch.setattr(cli, "_described", lambda step_dir: os.kill(os.getpid(), signal.SIGINT) or str(step_dir))
    handler = signal.getsignal(signal.SIGINT)
    assert cli.main(["export", str(tmp_path / "in"), str(tmp_path / "out")]) == 0
    assert "exported" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGINT) is handler  # the caller's handler back
