"""A tiny byte-level Llama trained on the built-in retrieval source (configs/retrieval-tiny.yaml, 1000 steps)
retrieves single needles at its training length, scored by `python -m train.evaluate`, where the same model before
training retrieves none. The commands run as a user runs them (one CPU device); about ten minutes on 2 cores."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "retrieval-tiny.yaml"
GRID = ["--lengths", "128", "--depths", "0,0.25,0.5,0.75,1", "--tasks", "single", "--samples", "32"]
# Mean single-needle accuracy over the grid, every digit of a random 7-digit value right (chance: 1e-7). Untrained:
# 0; trained with train.seed 0, 1 and 2: 0.57, 1.0 and 0.88 (32 haystacks per depth).
THRESHOLD = 0.25


def python(*args: str) -> None:
    """Runs `python ARGS` in the repository without the tests' simulated devices; fails with its error output."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"python {' '.join(args)} failed:\n{done.stderr[-3000:]}"


def accuracy(run: pathlib.Path, out: pathlib.Path) -> float:
    """The mean accuracy of `python -m train.evaluate RUN` over GRID."""
    python("-m", "train.evaluate", str(run), *GRID, "--out", str(out))
    return float(np.mean([r["accuracy"] for r in json.loads((out / "needle.json").read_text())]))


@pytest.mark.slow
def test_a_tiny_model_learns_to_retrieve_needles(tmp_path):
    run = tmp_path / "run"
    train = ["-m", "train", str(CONFIG), f"train.output_dir={run}", "train.progress_bar=false"]
    python(*train, "train.steps=1", "optimizer.decay_steps=1000")  # one update at 1/30 of the rate: untrained
    untrained = accuracy(run, tmp_path / "untrained")
    python(*train, "optimizer.decay_steps=1000")  # resumes: the same 1000 steps as one run
    trained = accuracy(run, tmp_path / "trained")
    assert untrained < THRESHOLD <= trained, f"accuracy untrained {untrained:.2f}, trained {trained:.2f}"
