"""Checkpoints that move: a data position saved by two processes (one `process_I-of-2.json` each, as checkpoints
were written before the position became one JSON item) resumes in one process; a `data` item the run cannot use
is refused by step and difference and nothing is moved; a checkpoint saved on 8 devices exports in a process with
one device (equal to transformers' logits), past a damaged newest step, naming the step it wrote.
(tests/train/test_distributed.py, slow: two processes -> one -> two, equal to an uninterrupted run.)"""

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from models.hf import load_pretrained
from parallel.mesh import make_mesh, state_shardings
from tests.models.test_hf_llama import hf_llama, hf_logits, tokens
from tests.tiny_models import TINY_LLAMA
from tests.train.tiny_run import REPO
from train import hf as cli
from train.checkpoints.checkpoint import Checkpointer
from train.config import MeshConfig, OptimizerConfig
from train.errors import CheckpointError
from train.optimizer import make_optimizer
from train.state import abstract_state

MODEL = TINY_LLAMA
TX = make_optimizer(OptimizerConfig(), 10)
STEP, ITEMS_READ = 7, 3


def data_iterator():
    return iter(grain.MapDataset.range(100).to_iter_dataset())


def listing(directory: pathlib.Path) -> list[str]:
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


@pytest.fixture(scope="module")
def two_process_checkpoint(tmp_path_factory):
    """(checkpoints/ holding step STEP as two processes wrote it before: data/process_{0,1}-of-2.json, through
    grain's handler; the (model, optimizer) state saved)."""
    _, abstract, shardings = abstract_state(MODEL, TX, make_mesh(MeshConfig(fsdp=8)))
    state = jax.device_put(jax.tree.map(lambda a: np.ones(a.shape, a.dtype), abstract), shardings)
    iterator = data_iterator()
    for _ in range(ITEMS_READ):
        next(iterator)
    directory = tmp_path_factory.mktemp("two-processes") / "checkpoints"
    with ocp.CheckpointManager(directory) as manager:
        manager.save(
            STEP,
            args=ocp.args.Composite(
                model=ocp.args.StandardSave(nnx.to_pure_dict(state[0])),
                optimizer=ocp.args.StandardSave(nnx.to_pure_dict(state[1])),
                data=grain.checkpoint.CheckpointSave(iterator),
                meta=ocp.args.JsonSave({"step": STEP, "config": {}}),
            ),
        )
    data = directory / str(STEP) / "data"
    (data / "process_0-of-1.json").rename(data / "process_0-of-2.json")
    shutil.copyfile(data / "process_0-of-2.json", data / "process_1-of-2.json")
    return directory, state


def restore(directory: pathlib.Path, iterator, fresh_if_unusable: bool = False):
    _, abstract, _ = abstract_state(MODEL, TX, make_mesh(MeshConfig(fsdp=8)))
    checkpointer = Checkpointer(directory, keep=3)
    try:
        return checkpointer.restore_latest(abstract, iterator, fresh_if_unusable=fresh_if_unusable)
    finally:
        checkpointer.close()


@pytest.mark.both_stacks  # JAX's distributed runtime
def test_a_data_position_written_by_two_processes_resumes_in_one(two_process_checkpoint, tmp_path):
    source, saved = two_process_checkpoint
    directory = pathlib.Path(shutil.copytree(source, tmp_path / "checkpoints"))
    iterator = data_iterator()
    step, state = restore(directory, iterator)
    assert step == STEP and next(iterator) == ITEMS_READ
    for restored, expected in zip(jax.tree.leaves(state), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(restored), np.asarray(expected))
    # saved again by this run: one JSON item that any number of processes reads
    checkpointer = Checkpointer(directory, keep=3)
    checkpointer.save(STEP + 1, state, iterator, {"config": {}})
    checkpointer.close()
    assert "metadata" in listing(directory / str(STEP + 1) / "data")
    assert not list((directory / str(STEP + 1) / "data").glob("process_*"))
    iterator = data_iterator()
    assert restore(directory, iterator)[0] == STEP + 1 and next(iterator) == ITEMS_READ + 1


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: [path.unlink() for path in data.iterdir()], r"its `data` item holds nothing, not metadata"),
        (lambda data: shutil.rmtree(data), r"it has no `data` item"),
        (
            lambda data: [path.rename(path.with_suffix(".txt")) for path in data.glob("*.json")],
            r"holds .*process_0-of-2.txt, process_1-of-2.txt, not metadata or process_I-of-N.json",
        ),
        (lambda data: (data / "process_0-of-2.json").write_text("{"), r"process_0-of-2.json does not read"),
        (
            lambda data: (data / "process_0-of-2.json").write_text('{"x": 1}'),
            r"its iterator state does not fit this run's data pipeline \(KeyError: .*\): saved by a version",
        ),
    ],
    ids=["no-file", "no-item", "unexpected-files", "not-json", "another-iterator"],
)
def test_a_data_position_the_run_cannot_use_is_refused_and_nothing_moved(
    two_process_checkpoint, tmp_path, damage, message
):
    directory = pathlib.Path(shutil.copytree(two_process_checkpoint[0], tmp_path / "checkpoints"))
    damage(directory / str(STEP) / "data")
    before = listing(directory)
    with pytest.raises(CheckpointError, match=rf"checkpoint step {STEP} in {directory} .*: .*{message}") as info:
        restore(directory, data_iterator())
    assert "Nothing was moved" in str(info.value) and "\n" not in str(info.value)
    assert "start the data position fresh with data.on_change=restart" in str(info.value)
    assert listing(directory) == before
    iterator = data_iterator()  # data.on_change=restart: the model, optimizer and step, the data from its start
    assert restore(directory, iterator, fresh_if_unusable=True)[0] == STEP and next(iterator) == 0
    assert listing(directory) == before


@pytest.fixture(scope="module")
def eight_device_run(tmp_path_factory):
    """(a run's checkpoints/ with step 40 saved on 8 devices (fsdp): a tiny random Hugging Face Llama's
    parameters as model and optimizer state, its architecture in `meta`; that Llama)."""
    root = tmp_path_factory.mktemp("eight-devices")
    reference = hf_llama(root / "hf", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = load_pretrained(root / "hf")
    state = nnx.state(model)
    assert len(jax.devices()) == 8
    state = jax.device_put(state, state_shardings(state, make_mesh(MeshConfig(fsdp=8))))
    assert len(jax.tree.leaves(state)[0].sharding.device_set) == 8
    checkpointer = Checkpointer(root / "checkpoints", keep=3)
    checkpointer.save(40, (state, state), data_iterator(), {"config": {"model": dataclasses.asdict(model.config)}})
    checkpointer.close()
    return root / "checkpoints", reference


def test_export_of_an_8_device_checkpoint_in_a_1_device_process_equals_transformers(eight_device_run, tmp_path):
    checkpoints, reference = eight_device_run
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS="--xla_backend_optimization_level=0")
    program = "import jax; assert jax.device_count() == 1; from train.hf import main; exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", program, "export", str(checkpoints), str(tmp_path / "out")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == f"exported step 40 of {checkpoints} to {tmp_path / 'out'}: 1 shard(s)\n"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = tokens()
    np.testing.assert_allclose(hf_logits(exported, ids), hf_logits(reference, ids), rtol=0, atol=1e-4)


def test_export_passes_over_a_damaged_newest_step_and_names_the_step(eight_device_run, tmp_path, capsys, caplog):
    checkpoints = pathlib.Path(shutil.copytree(eight_device_run[0], tmp_path / "checkpoints"))
    garble(pathlib.Path(shutil.copytree(checkpoints / "40", checkpoints / "60")) / "model")
    before = listing(checkpoints)
    assert cli.main(["export", str(checkpoints), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out == f"exported step 40 of {checkpoints} to {tmp_path / 'out'}: 1 shard(s)\n"
    assert f"cannot read the parameters in {checkpoints / '60' / 'model'}" in caplog.text
    assert "trying the checkpoint before it (nothing is moved)" in caplog.text
    assert listing(checkpoints) == before


def garble(item: pathlib.Path) -> None:
    for path in item.rglob("*"):
        if path.is_file():
            path.write_bytes(b"garbage")


@pytest.mark.parametrize("which", ["empty", "damaged"])
def test_an_export_that_cannot_read_a_checkpoint_says_so_in_one_line(eight_device_run, tmp_path, capsys, which):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    if which == "damaged":
        garble(pathlib.Path(shutil.copytree(eight_device_run[0] / "40", checkpoints / "40")) / "model")
    assert cli.main(["export", str(checkpoints), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: {checkpoints} holds no checkpoint"
        if which == "empty"
        else f"error: cannot read the parameters in {checkpoints / '40' / 'model'}"
    )
    assert err.count("\n") == 1


@pytest.mark.parametrize("error", [MemoryError(), jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")])
def test_a_restore_that_fails_for_want_of_memory_moves_nothing(two_process_checkpoint, tmp_path, monkeypatch, error):
    """Running out of memory while reading the arrays is not damage: refused in one line, nothing set aside."""
    directory = pathlib.Path(shutil.copytree(two_process_checkpoint[0], tmp_path / "checkpoints"))
    before = listing(directory)

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(ocp.CheckpointManager, "restore", fail)
    with pytest.raises(CheckpointError, match=rf"restoring checkpoint step {STEP} failed .* nothing was moved"):
        restore(directory, data_iterator())
    assert listing(directory) == before
