"""A checkpoint directory that cannot be written is refused before the first step; a save that fails mid-run (here
orbax's step directory cannot be made: a read-only file system from step 4 on, and closing the metrics writers
fails too) ends the run within seconds, in one line naming the library log and with exit status 2, and the
checkpoints saved before it are intact. What orbax, absl and TensorStore print meanwhile goes to that log, not the
screen."""

import errno
import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest
from flax import nnx

from tests.train.tiny_run import REPO, SMALL, TINY
from train.checkpoints.checkpoint import Checkpointer
from train.config import load_config
from train.errors import CheckpointError
from train.loop import run

READ_ONLY_FROM_STEP_4 = """
import errno, os, runpy, sys
make = os.mkdir
def mkdir(path, *args, **kwargs):  # orbax's directory of step 4 (and its temporary name) on a read-only disk
    if os.path.basename(os.fspath(path)).startswith("4."):
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
    return make(path, *args, **kwargs)
os.mkdir = mkdir
import tensorboardX
def full(self):  # and closing the metrics writers fails too
    raise OSError(errno.ENOSPC, "No space left on device")
tensorboardX.SummaryWriter.close = full
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("train", run_name="__main__")
"""


def test_a_save_that_fails_ends_the_run_in_one_line(tmp_path):
    command = [sys.executable, "-c", READ_ONLY_FROM_STEP_4, str(TINY), *SMALL, f"train.output_dir={tmp_path}"]
    overrides = ["train.steps=6", "checkpoint.every_steps=2", "train.sample_tokens=0", "train.eval_batches=0"]
    began = time.monotonic()
    done = subprocess.run(
        [*command, *overrides, "train.peak_tflops_per_device=1"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert time.monotonic() - began < 120  # not orbax's 300 s wait for its signals
    assert "Traceback" not in done.stderr and "absl" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "saving checkpoint step 4 (OSError: [Errno 30] Read-only file system" in errors[0]
    assert "intact (steps [2])" in errors[0] and f"library messages: {tmp_path / 'library.log'}" in errors[0]
    library = (tmp_path / "library.log").read_text()
    assert "Read-only file system" in library and "while closing the run: OSError(28" in library
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]


def test_an_unwritable_checkpoint_directory_is_refused_before_the_first_step(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(kwargs.get("dir")))

    monkeypatch.setattr("train.checkpoints.checkpoint.tempfile.TemporaryFile", read_only)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoints to .*checkpoints \(OSError: \[Errno 30\]"):
        run(load_config(TINY, [*SMALL, f"train.output_dir={tmp_path / 'run'}", "train.steps=2"]))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_checkpoint_directory_without_room_for_one_checkpoint_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "train.checkpoints.checkpoint.shutil.disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, 1000)
    )
    checkpoints = Checkpointer(tmp_path, keep=1)
    state = (nnx.State({"w": nnx.Param(jnp.zeros(1000))}), nnx.State({}))
    with pytest.raises(CheckpointError, match=r"one checkpoint needs about 3.91 KiB but .* has 1000 B free"):
        checkpoints.check_room(state)
    checkpoints.close()


def test_an_interrupted_saves_partial_checkpoint_counts_as_free_room(tmp_path, monkeypatch):
    """A save cut short by a full disk leaves its partial checkpoint, which orbax removes (now or soon): the next
    run's room check counts its bytes as free, not against the run. The disk's free bytes are 1000 and, once orbax
    has removed it (its clean-up may run while the test does), the partial checkpoint's too."""
    partial = tmp_path / "4.orbax-checkpoint-tmp-1764000000"
    shard = partial / "model" / "shard"
    monkeypatch.setattr(
        "train.checkpoints.checkpoint.shutil.disk_usage",
        lambda _: shutil._ntuple_diskusage(1, 1, 1000 + 3200 * (not shard.exists())),
    )
    checkpoints = Checkpointer(tmp_path, keep=1)
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"x" * 3200)
    checkpoints.check_room((nnx.State({"w": nnx.Param(jnp.zeros(1000))}), nnx.State({})))  # 4000 <= 1000 + 3200
    # orbax may have removed it by now
    with pytest.raises(CheckpointError, match=r"one checkpoint needs about 7.81 KiB but .* has (1000 B|4.1. KiB) free"):
        checkpoints.check_room((nnx.State({"w": nnx.Param(jnp.zeros(2000))}), nnx.State({})))
    checkpoints.close()


UNRAISABLE = """
import logging, sys
from train.process import library_log
library_log.install()
class Finalizer:
    def __del__(self):
        raise RuntimeError("Event loop is closed")
Finalizer()
logging.getLogger("absl").error("a library's error")
print(library_log.mention())
"""


def test_library_messages_go_to_the_library_log():
    done = subprocess.run([sys.executable, "-c", UNRAISABLE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    path = done.stdout.strip().removeprefix("(library messages: ").removesuffix(")")
    text = pathlib.Path(path).read_text()
    os.unlink(path)
    assert "RuntimeError: Event loop is closed" in text and "ERROR absl: a library's error" in text
