"""Multi-process runs: cluster settings from flags and environment, each process's batch rows, and (slow) two
processes x 4 CPU devices over gloo, killed (-9, both) after a checkpoint and restarted, training exactly like one
process with 8 devices; and a run's checkpoints carried from two processes to one and back (N -> 1 -> N), training
like one uninterrupted process; processes that resolved different configs refuse before any step."""

import json
import os
import pathlib
import random
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict

from models.hf.convert import abstract_model
from parallel.mesh import make_mesh, process_rows
from tests.train.tiny_run import REPO, SMALL, TINY, records
from train.checkpoints.checkpoint import restore_model_params
from train.config import ConfigError, MeshConfig
from train.hf import checkpoint_config
from train.process import distributed
from train.process.distributed import Cluster, resolve


def test_flags_override_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert resolve(None, None, None, env) == Cluster("h:1", 4, 3)
    assert resolve("g:2", 2, 0, env) == Cluster("g:2", 2, 0)
    assert resolve(None, None, None, {}) == Cluster()  # cluster auto-detection


@pytest.mark.parametrize(
    "flags, env, message",
    [
        ((None, 2, None), {}, r"not --coordinator \(or JAX_COORDINATOR_ADDRESS\), --process-id"),
        (("h:1", 2, 2), {}, r"process_id=2 must be in \[0, num_processes=2\)"),
        (("h", 2, 0), {}, "coordinator='h' must be host:port"),
        ((None, None, None), {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two': num_processes must be"),
    ],
)
def test_incomplete_or_bad_cluster_settings_are_named(flags, env, message):
    with pytest.raises(ConfigError, match=message):
        resolve(*flags, env)


def test_one_process_holds_every_row():
    mesh = make_mesh(MeshConfig(fsdp=4, context=2))
    np.testing.assert_array_equal(process_rows(mesh, 8), np.arange(8))


OVERRIDES = [
    *SMALL,
    "train.steps=6",
    "train.eval_batches=2",
    "train.eval_every_steps=3",
    "train.sample_tokens=4",
    "optimizer.warmup_steps=2",
    "checkpoint.every_steps=2",
]


def _start(
    output: pathlib.Path, extra: list[str], processes: int, each: list[list[str]] | None = None
) -> list[subprocess.Popen]:
    """Starts `python -m train` as `processes` processes sharing 8 CPU devices; `each[i]`: process i's own
    overrides."""
    port = random.randint(20000, 40000)
    args = [str(TINY), *OVERRIDES, *extra, f"train.output_dir={output}"]
    cluster = ["--distributed", f"--coordinator=127.0.0.1:{port}", f"--num-processes={processes}"]
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // processes}",
    )
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "train",
                *([*cluster, f"--process-id={i}"] if processes > 1 else []),
                *args,
                *(each[i] if each else []),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]


def _finish(runs: list[subprocess.Popen]) -> str:
    """Waits for every process and returns process 0's output; fails with the output of one that did not succeed."""
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    for run, out in zip(runs, outputs, strict=True):
        assert run.returncode == 0, out[-3000:]
    return outputs[0]


def _kill_when(condition, runs: list[subprocess.Popen], timeout: float = 300) -> None:
    """SIGKILLs every process once `condition()` holds (all still running)."""
    deadline = time.monotonic() + timeout
    while not condition():
        for run in runs:
            assert run.poll() is None, f"a process ended before it was killed: {run.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    for run in runs:
        run.kill()
        run.communicate()


def _losses(output: pathlib.Path) -> list[tuple[int, float, float | None]]:
    rows = records(output)
    return [(row["step"], row["loss"], row.get("eval_loss")) for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [["mesh.fsdp=8"], ["mesh.context=8", "parallel.context_strategy=ring"]])
def test_two_processes_killed_and_restarted_train_like_one(tmp_path, mesh):
    if jax.default_backend() != "cpu":
        pytest.skip("runs CPU devices")
    _finish(_start(tmp_path / "one", mesh, processes=1))
    output = tmp_path / "two"
    checkpointed = lambda: (output / "checkpoints" / "2").is_dir() and len(records(output)) >= 3
    _kill_when(checkpointed, _start(output, mesh, processes=2))
    _finish(_start(output, mesh, processes=2))  # resumes from step 2 or later
    one, two = _losses(tmp_path / "one"), _losses(output)
    assert [step for step, *_ in two] == list(range(1, 7))  # each written once, by process 0
    for (_, loss_one, eval_one), (_, loss_two, eval_two) in zip(one, two, strict=True):
        assert loss_two == pytest.approx(loss_one, rel=1e-5)
        assert (eval_two is None) == (eval_one is None)
        assert eval_one is None or eval_two == pytest.approx(eval_one, rel=1e-5)


def _params(step_dir: pathlib.Path) -> dict:
    """{path: host array} of the parameters in a run's step directory."""
    _, abstract = abstract_model(checkpoint_config(step_dir))
    return {
        key: np.asarray(value)
        for key, value in flatten_dict(nnx.to_pure_dict(restore_model_params(step_dir, abstract))).items()
    }


@pytest.mark.slow
def test_checkpoints_move_from_two_processes_to_one_and_back(tmp_path):
    """Two processes x 4 devices train to step 2, one process x 8 devices resumes to 4, two processes resume to 6:
    the losses and the parameters of step 6 equal an uninterrupted one-process run's, and nothing is set aside."""
    if jax.default_backend() != "cpu":
        pytest.skip("runs CPU devices")
    fixed = ["mesh.fsdp=8", "optimizer.decay_steps=6"]  # the schedule does not follow train.steps
    _finish(_start(tmp_path / "one", fixed, processes=1))
    output = tmp_path / "moved"
    for start, steps, processes in ((0, 2, 2), (2, 4, 1), (4, 6, 2)):
        printed = _finish(_start(output, [*fixed, f"train.steps={steps}"], processes))
        assert (f"resumed from step {start}" in printed) == (start > 0), printed[-3000:]
    one, moved = _losses(tmp_path / "one"), _losses(output)
    assert [step for step, *_ in moved] == list(range(1, 7))
    for (_, loss_one, eval_one), (_, loss_moved, eval_moved) in zip(one, moved, strict=True):
        assert loss_moved == pytest.approx(loss_one, rel=1e-5)
        assert eval_one is None or eval_moved == pytest.approx(eval_one, rel=1e-5)  # (each run evaluates at its end)
    expected, params = _params(tmp_path / "one" / "checkpoints" / "6"), _params(output / "checkpoints" / "6")
    assert sorted(params) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(params[key], value, rtol=1e-4, atol=1e-6, err_msg=str(key))
    assert not list((output / "checkpoints").glob("*.corrupt*"))


def test_processes_that_resolved_different_configs_refuse_before_any_step(tmp_path):
    runs = _start(tmp_path, [], 2, each=[["data.seed=0"], ["data.seed=1"]])
    for run in runs:
        printed = run.communicate(timeout=300)[0]
        assert run.returncode == 2, printed[-3000:]
        assert printed.strip().splitlines()[-1] == (
            "error: the 2 processes of this run resolved different configs: data.seed: 0 in process 0, 1 in process "
            "1. Start every process with the same config and overrides"
        )
    assert not (tmp_path / "metrics.jsonl").exists()


class Store:
    """The coordination service's key-value store, in a dict (every process has published)."""

    def __init__(self, values: dict):
        self.values = values

    def key_value_set(self, key, value):
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        return self.values[key]


def test_agreeing_processes_pass_and_the_differences_are_named():
    config = {"data": {"seed": 0, "sources": ["a", "b"]}, "train": {"steps": 10}}
    store = Store({f"{distributed.CONFIG_KEY}1": json.dumps(config)})
    distributed.agree(store, 0, 2, config, 1.0)
    other = {"data": {"seed": 0, "sources": ["a"]}, "train": {"steps": 12}}
    store.values[f"{distributed.CONFIG_KEY}1"] = json.dumps(other)
    with pytest.raises(
        ConfigError, match=r"data.sources: \['a', 'b'\] in process 0, \['a'\] in process 1; train.steps"
    ):
        distributed.agree(store, 0, 2, config, 1.0)
