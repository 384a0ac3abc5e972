"""Every evaluation setting is checked before a run trains (a needle length too short for a task, an unknown task,
named in one line; `train.needle_tasks` chooses the tasks), and an evaluation that fails mid-run is one line that
costs neither the run nor the step's checkpoint."""

import numpy as np
import pytest

import train.__main__ as cli
from tests.train.tiny_run import SMALL, TINY, records
from train.data.haystack import check_grid
from train.data.tokenizer import ByteTokenizer
from train.trainer import Trainer

FILLER = ByteTokenizer().encode("The grass is green. The sky is blue. Here we go. There and back again. ")
GRID = dict(depths=[0.5], samples=2, seed=0)
RUN = [*SMALL, "train.steps=2", "train.eval_every_steps=2", "train.eval_batches=1", "train.sample_tokens=0"]


def test_a_length_holds_a_task_or_the_check_names_it():
    check_grid(FILLER, ByteTokenizer(), tasks=["single"], lengths=[256], **GRID)
    with pytest.raises(ValueError, match=r"a multi_key haystack needs more than \d+ tokens; got length 256"):
        check_grid(FILLER, ByteTokenizer(), tasks=["single", "multi_key"], lengths=[256], **GRID)


@pytest.mark.parametrize(
    "setting, words",
    [
        (["train.needle_lengths=[256]"], "train.needle_lengths=[256]: a multi_key haystack needs more than"),
        (["train.needle_lengths=[512]", "train.needle_tasks=[single,fetch]"], "fetch unknown; choose from"),
    ],
)
def test_a_needle_setting_that_cannot_run_stops_the_run_before_it_trains(setting, words, tmp_path, capsys):
    output = tmp_path / "run"
    assert cli.main([str(TINY), *RUN, *setting, f"train.output_dir={output}"]) == 2
    error = capsys.readouterr().err
    assert [line for line in error.splitlines() if line.startswith("error:")] == [
        next(line for line in error.splitlines() if words in line)
    ] and "Traceback" not in error, error
    assert not (output / "checkpoints").exists() and not (output / "metrics.jsonl").exists()


def test_a_failed_evaluation_is_one_line_and_the_step_is_saved(tmp_path, monkeypatch, capfd):
    def fails(self):
        raise RuntimeError("planted\nsecond line")

    monkeypatch.setattr(Trainer, "_evaluate", fails)
    output = tmp_path / "run"
    argv = [*RUN, "train.needle_lengths=[256]", "train.needle_tasks=[single]", "checkpoint.every_steps=2"]
    assert cli.main([str(TINY), *argv, f"train.output_dir={output}"]) == 0
    out = "".join(capfd.readouterr())
    assert "the evaluation at step 2 failed (RuntimeError: planted); training goes on" in out
    assert "second line" not in out
    assert sorted(p.name for p in (output / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    assert [r["step"] for r in records(output)] == [1, 2] and np.isfinite(records(output)[-1]["loss"])
