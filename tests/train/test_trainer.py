"""The step loop's cadence: for every combination of logging, evaluation and checkpoint intervals the last step is
logged (and so checked for a non-finite loss), every evaluation is logged, and checkpoints fall where asked; two
real runs, one with checkpoints and evaluation off and a step count that is no multiple of the log interval (its
last step went unlogged, and run() returned the step before's metrics)."""

import itertools

import pytest

from tests.train.tiny_run import SMALL, TINY, records
from train.config import load_config
from train.loop import run
from train.trainer import Cadence


@pytest.mark.parametrize("steps", [4, 5, 6])
def test_every_cadence_logs_the_last_step_and_every_evaluation(steps):
    for log_every, eval_every, evaluates, save_every in itertools.product(
        (1, 2, 3), (0, 1, 2, 4), (False, True), (None, 1, 2, 4)
    ):
        cadence = Cadence(steps, log_every, eval_every, evaluates, save_every)
        what = cadence
        every = range(1, steps + 1)
        evaluated = [s for s in every if cadence.evaluates_at(s)]
        logged = [s for s in every if cadence.logs_at(s)]
        saved = [s for s in every if cadence.saves_at(s, stopping=False)]
        assert steps in logged, what
        assert set(evaluated) <= set(logged), what
        multiples = {s for s in every if s % log_every == 0}
        assert set(logged) == multiples | {steps} | set(evaluated), what
        if evaluates:
            assert evaluated == [s for s in every if s == steps or (eval_every and s % eval_every == 0)], what
        else:
            assert evaluated == [], what
        if save_every is None:
            assert saved == [] and not cadence.saves_at(2, stopping=True), what
        else:
            assert saved == [s for s in every if s % save_every == 0 or s == steps], what
            assert cadence.saves_at(1, stopping=True), what


def overrides(tmp_path, *extra):
    return [*SMALL, "train.sample_tokens=0", f"train.output_dir={tmp_path}", *extra]


def test_the_last_step_is_logged_and_returned_with_checkpoints_and_evaluation_off(tmp_path):
    extra = ["train.steps=5", "train.log_every_steps=2", "train.eval_batches=0", "checkpoint.enabled=false"]
    last = run(load_config(TINY, overrides(tmp_path, *extra)))
    assert [row["step"] for row in records(tmp_path)] == [2, 4, 5]
    assert last["step"] == 5 and last["loss"] == records(tmp_path)[-1]["loss"]
    assert not (tmp_path / "checkpoints").exists()


def test_logs_evaluations_and_checkpoints_fall_where_asked(tmp_path):
    extra = ["train.steps=5", "train.log_every_steps=2", "train.eval_batches=1", "train.eval_every_steps=2"]
    run(load_config(TINY, overrides(tmp_path, *extra, "checkpoint.every_steps=3", "checkpoint.keep=3")))
    rows = records(tmp_path)
    assert [row["step"] for row in rows] == [2, 4, 5]
    assert all("eval_loss" in row for row in rows)
    assert sorted(int(path.name) for path in (tmp_path / "checkpoints").iterdir()) == [3, 5]
