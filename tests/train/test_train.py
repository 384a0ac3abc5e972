"""Training runs in-process: loss falls, outputs are written and a sample is printed; fine-tuning from a
checkpoint; bad input stops with a clear error before anything is lost."""

import contextlib
import io
import json
import os
import pathlib
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.hf.convert import abstract_model
from tests.train import tiny_run
from tests.train.tiny_run import records
from train import divergence
from train.checkpoints.checkpoint import Checkpointer, restore_model_params
from train.checkpoints.lock import run_directory_lock
from train.config import ConfigError, load_config
from train.data.haystack import needle_grid
from train.data.tokenizer import make_tokenizer
from train.errors import CheckpointError, NonFiniteLoss
from train.evaluate import main as evaluate_main
from train.loop import run
from train.needle import filler_tokens

SMALL = [
    *tiny_run.SMALL,
    "compute.remat_policy=none",
    "train.sample_tokens=0",
    "train.eval_batches=1",
    "optimizer.warmup_steps=5",
    "optimizer.learning_rate=3e-3",
]


def config(tmp_path, *overrides):
    return load_config(tiny_run.TINY, [*SMALL, f"train.output_dir={tmp_path}", *overrides])


def train(output):
    """40 steps with evaluations and checkpoints at 20 and 40, then a sample; what it prints goes to stdout.txt."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run(
            config(
                output,
                "train.steps=40",
                "checkpoint.every_steps=20",
                "train.eval_every_steps=20",
                "train.sample_tokens=8",
            )
        )
    (output / "stdout.txt").write_text(printed.getvalue())


@pytest.fixture(scope="module")
def trained(shared_run):
    """The output directory of `train`, one run for the whole session (read only by the tests)."""
    return shared_run("test_train-trained", train)


def test_loss_falls_and_outputs_are_written(trained):
    lines = records(trained)
    assert [r["step"] for r in lines] == list(range(1, 41))
    for record in lines:  # step 1 compiles: no rate
        rates = {"tokens_per_sec", "mfu", "step_time"} if record["step"] > 1 else set()
        assert {"step", "loss", "learning_rate", "grad_norm", *rates} <= set(record)
    first, last = sum(r["loss"] for r in lines[:3]) / 3, sum(r["loss"] for r in lines[-3:]) / 3
    assert last < first - 1.5, (first, last)
    assert [r["step"] for r in lines if "eval_loss" in r] == [20, 40]
    assert list((trained / "tensorboard").glob("events.out.tfevents.*"))
    assert (trained / "config.yaml").exists()
    assert sorted(int(p.name) for p in (trained / "checkpoints").iterdir() if p.name.isdigit()) == [20, 40]


def test_sample_is_printed(trained):
    assert "--- sample ---" in (trained / "stdout.txt").read_text()


def test_params_only_init_from_checkpoint_seeds_fine_tuning(trained, tmp_path):
    fresh_first = records(trained)[0]["loss"]
    trained_last = records(trained)[-1]["loss"]
    run(
        config(
            tmp_path / "tuned",
            "train.steps=1",
            f"checkpoint.init_from={trained / 'checkpoints'}",
            "train.eval_batches=0",
        )
    )
    tuned_first = records(tmp_path / "tuned")[0]["loss"]
    assert abs(tuned_first - trained_last) < abs(tuned_first - fresh_first), (fresh_first, trained_last, tuned_first)


def test_missing_data_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="/no/such/corpus"):
        run(config(tmp_path, "data.source=/no/such/corpus"))
    assert not (tmp_path / "checkpoints").exists()


def test_empty_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        run(config(tmp_path / "out", f"data.source={corpus}"))


def test_a_second_run_on_the_same_output_dir_is_refused(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    with (
        run_directory_lock(tmp_path),
        pytest.raises(ConfigError, match=rf"is in use by another run \(process {os.getpid()}\)"),
    ):
        run(config(tmp_path))
    with run_directory_lock(tmp_path):  # released when the holder is done (or killed: the OS drops it)
        pass


def test_tokenizer_larger_than_model_vocab(tmp_path):
    with pytest.raises(ConfigError, match=r"259 tokens but model.vocab_size=128"):
        run(config(tmp_path, "model.vocab_size=128"))


def test_resuming_with_another_model_is_refused(trained):
    with pytest.raises(ConfigError, match=re.escape("model.embed_dim=64, now 128")):
        run(config(trained, "model.embed_dim=128"))


@pytest.mark.parametrize("change", ["data.seq_len=128", "train.batch_size=16"])
def test_resuming_with_another_data_shape_is_refused(trained, change):
    key, value = change.split("=")
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}=\d+, now {value}: a resumed run keeps"):
        run(config(trained, change))


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    with pytest.raises(NonFiniteLoss) as info:
        run(
            config(
                tmp_path,
                "train.steps=8",
                "optimizer.learning_rate=1e30",
                "optimizer.warmup_steps=0",
                "optimizer.clip_norm=0",
                "checkpoint.every_steps=1",
                "train.eval_batches=0",
            )
        )
    failed = int(re.match(r"not finite at step (\d+): ", str(info.value))[1])
    assert f"Last good checkpoint: none (step {failed - 1} saved the states that gave a non-finite loss" in str(
        info.value
    ), str(info.value)  # step 1's update already broke the model: the checkpoint after it is no good
    assert "set optimizer.clip_norm > 0 (e.g. 1.0; now 0: no clipping) or lower optimizer.learning_rate" in str(
        info.value
    )
    checkpoints = Checkpointer(tmp_path / "checkpoints", keep=3)
    assert checkpoints.manager.latest_step() == failed - 1  # kept, not deleted
    checkpoints.close()


def test_the_last_good_checkpoint_is_one_whose_state_trained():
    config = load_config(tiny_run.TINY, SMALL)
    unhealthy = {6, 7}  # the states steps 7 and 8 ran on: a collapsed model (zero gradients), then NaN
    assert not divergence.healthy({"loss": 5.5, "grad_norm": 0.0})
    line = divergence.message(
        8, {"loss": float("nan"), "grad_norm": 0.0}, config, pathlib.Path("c"), [4, 6, 7], unhealthy
    )
    assert line == (
        "not finite at step 8: loss nan, grad_norm 0.0; stopped without saving this state. Last good checkpoint: step "
        "4 in c (steps 6, 7 saved the states that gave a non-finite loss or all-zero gradients: move them aside to "
        "resume from it). Then: lower optimizer.learning_rate (now 0.003) or raise optimizer.warmup_steps (now 5); "
        "gradients are clipped to 1."
    )


def copy_run(trained, tmp_path) -> pathlib.Path:
    """A copy of the shared run for a test that changes it."""
    return pathlib.Path(shutil.copytree(trained, tmp_path / "run", ignore=shutil.ignore_patterns(".lock")))


def steps_kept(output) -> list[str]:
    return sorted(path.name for path in (output / "checkpoints").iterdir())


def test_resuming_with_another_optimizer_structure_is_refused_not_set_aside(trained, tmp_path):
    output = copy_run(trained, tmp_path)
    before = {name: (output / name).read_text() for name in ("metrics.jsonl", "config.yaml")}
    with pytest.raises(
        CheckpointError, match=r"optimizer state: .*Changed since it was saved: optimizer.clip_norm: 1.0"
    ):
        run(config(output, "train.steps=41", "optimizer.clip_norm=0"))
    assert steps_kept(output) == ["20", "40"]
    assert {name: (output / name).read_text() for name in before} == before


def garble(item: pathlib.Path) -> None:
    for path in item.rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")


def test_unreadable_checkpoints_are_set_aside_and_never_started_over(trained, tmp_path):
    output = copy_run(trained, tmp_path)
    checkpoints = output / "checkpoints"
    shutil.copytree(checkpoints / "20", checkpoints / "40.corrupt")  # set aside by an earlier run
    garble(checkpoints / "40" / "model")
    run(config(output, "train.steps=20"))  # resumes from 20, the last step: nothing to train
    assert steps_kept(output) == ["20", "40.corrupt", "40.corrupt.1"]
    garble(checkpoints / "20" / "optimizer")
    for _ in range(2):  # set aside, then refused again rather than trained from step 0 over the old run
        with pytest.raises(CheckpointError, match=r"can be read \(set aside: 20.corrupt, 40.corrupt, 40.corrupt.1\)"):
            run(config(output, "train.steps=20"))
    assert not (checkpoints / "20").exists()


def test_init_from_another_architecture_or_a_damaged_checkpoint_makes_no_run_directory(trained, tmp_path):
    with pytest.raises(CheckpointError, match=r"another model than this run's \(embed_dim: 64 there, 128 here\)"):
        run(config(tmp_path / "new", f"checkpoint.init_from={trained / 'checkpoints'}", "model.embed_dim=128"))
    # the same shapes, another model: refused by its saved architecture
    with pytest.raises(CheckpointError, match=r"another model than this run's \(sliding_window: 0 there, 16 here\)"):
        run(config(tmp_path / "new", f"checkpoint.init_from={trained / 'checkpoints'}", "model.sliding_window=16"))
    damaged = pathlib.Path(shutil.copytree(trained / "checkpoints" / "40" / "model", tmp_path / "damaged" / "model"))
    largest = max((path for path in damaged.rglob("*") if path.is_file()), key=lambda path: path.stat().st_size)
    os.truncate(largest, largest.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        run(config(tmp_path / "new", f"checkpoint.init_from={damaged.parent}"))
    assert not (tmp_path / "new").exists()


def test_a_full_disk_stops_before_saving_and_keeps_the_checkpoints(trained, tmp_path, monkeypatch):
    output = copy_run(trained, tmp_path)
    monkeypatch.setattr(
        "train.checkpoints.checkpoint.shutil.disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, 1000)
    )
    checkpoints = Checkpointer(output / "checkpoints", keep=1)
    state = (nnx.State({"w": nnx.Param(jnp.zeros(1000))}), nnx.State({}))
    with pytest.raises(
        CheckpointError, match=r"step 41 needs about 3.91 KiB .* has 1000 B free; .* intact \(steps \[20, 40\]\)"
    ):
        checkpoints.save(41, state, data_iterator=None, meta={})
    checkpoints.close()
    assert steps_kept(output) == ["20", "40"]


def plain_needle_grid(step_dir: pathlib.Path, *, tasks, lengths) -> list[dict]:
    """The needle grid of train.evaluate (same haystacks: filler, seed, depths 0.2 / 0.8, 2 samples) scored by the
    checkpoint's model on one device, a whole unpadded row per forward pass, no mesh or sequence layout."""
    config = load_config(step_dir.parent.parent / "config.yaml", ["checkpoint.init_from="])
    tokenizer = make_tokenizer(config.data.tokenizer)
    graphdef, abstract = abstract_model(config.model)
    model = nnx.merge(graphdef, restore_model_params(step_dir, abstract))

    def predict(tokens, at):
        logits = np.asarray(model(jnp.asarray(tokens)))  # [rows, length, vocab]
        return np.take_along_axis(logits.argmax(-1), at, axis=1)

    filler = filler_tokens(config, tokenizer, max(lengths))
    return needle_grid(
        predict, filler, tokenizer, tasks=tasks, lengths=lengths, depths=[0.2, 0.8], samples=2, seed=config.train.seed
    )


def test_needle_evaluation_of_a_run_writes_records_a_heatmap_and_scalars(trained, tmp_path, capsys):
    """The command's accuracies are those of the checkpoint's model scored on one device without a mesh."""
    lengths, depths = [320, 384], [0.2, 0.8]
    args = ["--lengths", "320,384", "--depths", "0.2,0.8", "--tasks", "single,multi_key", "--samples", "2"]
    assert evaluate_main([str(trained / "checkpoints" / "20"), *args, "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "needle.json").read_text())
    grid = [(task, length, depth) for task in ("single", "multi_key") for length in lengths for depth in depths]
    assert [(r["task"], r["length"], r["depth"]) for r in records] == grid
    expected = plain_needle_grid(trained / "checkpoints" / "20", tasks=("single", "multi_key"), lengths=lengths)
    assert [r["accuracy"] for r in records] == [r["accuracy"] for r in expected]
    assert (tmp_path / "needle.png").read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    captured = capsys.readouterr()
    assert "multi_key      384 tokens  depth 80%" in captured.out
    assert f"parameters from {trained / 'checkpoints' / '20'}" in captured.err
    assert evaluate_main([str(tmp_path / "nowhere"), *args]) == 2
    assert "is neither a run directory" in capsys.readouterr().err
