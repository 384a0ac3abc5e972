"""Wrong input is one line and a non-zero exit before anything trains; a command that has nothing to do says so:
a config that is not UTF-8 or is a directory, a value of the wrong type, rows longer than the positions the model
covers, an indexer turned off while its settings remain, a sample longer than a train step's tokens, an export shard
size that is not positive, a kernel the platform cannot run, an override given twice, a resume past train.steps."""

import pytest

import train.__main__ as cli
import train.hf
from tests.train.tiny_run import SMALL, TINY, records

RUN = [*SMALL, "train.steps=2", "train.eval_batches=0", "train.sample_tokens=0"]


def refused(argv, capsys) -> str:
    """The one error line `python -m train ARGV` printed, having exited 2."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_a_config_that_is_not_utf8_or_is_a_directory(tmp_path, capsys):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"# caf\xe9\ntrain:\n  steps: 2\n")
    assert "is not UTF-8 text (byte 0xe9 at offset 5); save it as UTF-8" in refused([str(latin)], capsys)
    (tmp_path / "config.yaml").write_text("train:\n  steps: 2\n")
    line = refused([str(tmp_path)], capsys)
    assert "is a directory; give a YAML file (a run directory's is its config.yaml)" in line


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["parallel.expert_capacity_factor=abc"], "has type str; expected float or null"),
        (["model.max_position_embeddings=128", "data.seq_len=512"], "set model.context_length=512 to stretch"),
        (["parallel.attention_kernel=flash3"], "not cpu; choose blockwise or auto"),
        (["train.sample_tokens=40", "train.sample_prompt=" + "x" * 600], "needs 641 positions, more than the 512"),
    ],
)
def test_a_setting_that_cannot_run_is_one_line(overrides, words, tmp_path, capsys):
    argv = [str(TINY), *RUN, *overrides, f"train.output_dir={tmp_path / 'run'}"]
    assert words in refused(argv, capsys)
    assert not (tmp_path / "run").exists()


def test_an_indexer_turned_off_with_its_settings_left_is_named(capsys):
    config = str(TINY.parent / "deepseek-v3.2-tiny.yaml")
    line = refused([config, "model.index_topk=0", "--plan"], capsys)
    assert "model.index_topk=0 turns sparse attention's indexer off, yet model.index_heads=8" in line


def test_an_export_shard_size_must_be_positive(capsys):
    for size in ("0", "-5", "two"):
        with pytest.raises(SystemExit) as stopped:
            train.hf.main(["export", "in", "out", "--max-shard-bytes", size])
        assert stopped.value.code == 2
        assert f"argument --max-shard-bytes: '{size}' is not a positive number of bytes" in capsys.readouterr().err


def test_an_override_given_twice_is_named(capsys):
    assert cli.main([str(TINY), *RUN, "train.steps=3", "train.steps=4", "--plan", "--devices", "1"]) == 0
    assert "override train.steps given twice ('train.steps=3', then 'train.steps=4'): the last is used" in (
        capsys.readouterr().err
    )


def test_a_resume_past_train_steps_says_there_is_nothing_to_train(tmp_path, capfd):
    argv = [str(TINY), *RUN, "checkpoint.every_steps=2", f"train.output_dir={tmp_path}"]
    assert cli.main(argv) == 0
    assert cli.main([*argv, "train.steps=1"]) == 0
    out = "".join(capfd.readouterr())
    assert "resumed at step 2, which train.steps=1 does not pass: nothing to train (raise train.steps" in out
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
