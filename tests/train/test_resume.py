"""Exact resume: a run interrupted (SIGTERM; SIGKILL mid-checkpoint; a corrupt newest checkpoint beside a leftover
partial one; slow: SIGKILL at ten random moments) and restarted with the same command logs the same per-step
losses, bit for bit, as an uninterrupted run."""

import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.train.tiny_run import REPO, SMALL, TINY, records
from train.metrics import truncate_jsonl

STEPS = 8
OVERRIDES = [
    *SMALL,
    "compute.remat_policy=none",
    "train.sample_tokens=0",
    "train.eval_batches=0",
    "optimizer.warmup_steps=2",
    f"optimizer.decay_steps={STEPS}",
    "checkpoint.every_steps=2",
    "checkpoint.keep=3",
    "train.peak_tflops_per_device=1",  # the MFU's peak given: no CPU matmul benchmark at start
]


def command(output: pathlib.Path, steps: int = STEPS) -> list[str]:
    return [
        sys.executable,
        "-m",
        "train",
        str(TINY),
        *OVERRIDES,
        f"train.steps={steps}",
        f"train.output_dir={output}",
    ]


def start(output, steps=STEPS) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        command(output, steps), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(output, steps=STEPS) -> str:
    process = start(output, steps)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return err


def losses(output: pathlib.Path) -> dict[int, float]:
    rows = records(output)
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)), f"steps logged twice or out of order: {steps}"
    return {r["step"]: r["loss"] for r in rows}


def logged_steps(output: pathlib.Path) -> int:
    path = output / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for(condition, process, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"run ended early: {process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def reference(shared_run):
    """Per-step losses of the uninterrupted run (one run for the whole session)."""
    result = losses(shared_run("test_resume-uninterrupted", finish))
    assert sorted(result) == list(range(1, STEPS + 1))
    return result


def test_sigterm_saves_and_resumes_exactly(reference, tmp_path):
    process = start(tmp_path)
    wait_for(lambda: logged_steps(tmp_path) >= 3, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "rerun the same command to resume" in err
    stopped_at = max(losses(tmp_path))
    assert stopped_at < STEPS and (tmp_path / "checkpoints" / str(stopped_at)).is_dir()
    finish(tmp_path)
    assert losses(tmp_path) == reference


@pytest.mark.slow  # the partial checkpoint it leaves: test_corrupt_newest_and_leftover_partial_checkpoints_are_skipped
def test_sigkill_while_a_checkpoint_is_written_resumes_exactly(reference, tmp_path):
    """Killed while the checkpoint of step 4 or later is written, after steps beyond the last complete one were
    logged: the rerun resumes from that one, logs those steps once more (each once) and leaves no partial
    checkpoint."""
    process = start(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    writing = lambda: checkpoints.is_dir() and any("tmp" in p.name for p in checkpoints.iterdir())
    wait_for(lambda: logged_steps(tmp_path) >= 3 and writing(), process)
    process.kill()
    process.communicate()
    finish(tmp_path)
    assert losses(tmp_path) == reference
    assert not any("tmp" in p.name for p in checkpoints.iterdir())


@pytest.mark.newest_stack
def test_corrupt_newest_and_leftover_partial_checkpoints_are_skipped(reference, tmp_path):
    """The newest complete checkpoint (6) is corrupt and a partial one (8, no optimizer state) is left over: the
    partial one is removed without being read, the corrupt one set aside with a warning naming the `mv` that
    undoes it, and the run resumes from 4."""
    finish(tmp_path, steps=6)  # decay_steps is fixed, so stopping at 6 and going on to 8 changes nothing
    checkpoints = tmp_path / "checkpoints"
    for path in (checkpoints / "6" / "model").rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(b"garbage")
    partial = checkpoints / "8.orbax-checkpoint-tmp"
    shutil.copytree(checkpoints / "4", partial)
    shutil.rmtree(partial / "optimizer")
    err = finish(tmp_path)
    assert err.count("cannot be read") == 1 and f"(to undo: mv {checkpoints / '6.corrupt'} {checkpoints / '6'})" in err
    assert "Traceback" not in err and "Exception ignored" not in err  # the libraries' accounts: RUN/library.log
    assert (checkpoints / "6.corrupt").is_dir() and not partial.exists()
    assert losses(tmp_path) == reference


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(reference, tmp_path):
    """Ten kills (-9) at random moments from start-up to the end, each followed by the same command again (in a new
    directory once a run has finished): every step is logged once and every loss is bit-exact."""
    began = time.monotonic()
    finish(tmp_path / "timed")
    duration = time.monotonic() - began
    rng, runs, after_a_checkpoint = random.Random(0), 0, 0
    for _ in range(10):
        output = tmp_path / f"run{runs}"
        process = start(output)
        time.sleep(rng.uniform(0.2, 1.0) * duration)
        process.kill()
        _, err = process.communicate()
        after_a_checkpoint += (output / "checkpoints").is_dir() and any((output / "checkpoints").glob("[0-9]*"))
        logged = losses(output) if (output / "metrics.jsonl").exists() else {}
        assert logged == {step: reference[step] for step in logged}, err[-3000:]
        if process.returncode == 0:  # it finished before the kill
            assert logged == reference
            runs += 1
    finish(tmp_path / f"run{runs}")
    assert losses(tmp_path / f"run{runs}") == reference
    assert after_a_checkpoint >= 3, "too few kills found a checkpoint to resume from"


def test_a_metrics_line_cut_short_by_a_crash_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    truncate_jsonl(path, 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
