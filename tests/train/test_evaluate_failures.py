"""`python -m train.evaluate` when something goes wrong mid-way: a newest checkpoint cut short is passed over to the
one before with nothing of asyncio's on the screen (an abandoned read's "Task exception was never retrieved" goes to
the library log), and Ctrl-C ends it in one line with exit status 130. The run is made without training: two steps
of random parameters (orbax `model` items) beside its config.yaml."""

import asyncio
import gc
import json
import pathlib
import signal
import subprocess
import sys
import time

import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx

import models
from tests.train import tiny_run
from train.config import load_config, to_dict
from train.evaluate import main as evaluate_main
from train.process import library_log

GRID = ["--lengths", "128", "--depths", "0.5", "--tasks", "single", "--samples", "1"]
TEXT = "def double(x):\n    return 2 * x\n\n" * 400


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory: config.yaml (a small tiny.yaml on a text file) and checkpoints 1 and 2."""
    root = tmp_path_factory.mktemp("evaluate")
    (root / "text.txt").write_text(TEXT)
    overrides = [*tiny_run.MODEL, f"data.source={root / 'text.txt'}", f"train.output_dir={root}"]
    config = load_config(tiny_run.TINY, overrides)
    (root / "config.yaml").write_text(yaml.safe_dump(to_dict(config)))
    with ocp.StandardCheckpointer() as checkpointer:
        for step in (1, 2):
            params = nnx.to_pure_dict(nnx.state(models.build(config.model, rngs=nnx.Rngs(step))))
            checkpointer.save(root / "checkpoints" / str(step) / "model", params)
    return root


def test_a_truncated_array_file_falls_back_without_a_traceback(run, tmp_path, capsys, caplog, library_file):
    arrays = [path for path in (run / "checkpoints" / "2" / "model").rglob("d/*") if path.is_file()]
    largest = max(arrays, key=lambda path: path.stat().st_size)
    data = largest.read_bytes()
    try:
        largest.write_bytes(data[: len(data) // 2])
        assert evaluate_main([str(run), *GRID, "--out", str(tmp_path)]) == 0
        gc.collect()  # an abandoned read's asyncio task reports its exception when it is collected
    finally:
        largest.write_bytes(data)
    err = capsys.readouterr().err
    assert f"parameters from {run / 'checkpoints' / '1'}" in err
    assert "Task exception" not in err  # nor does a record of asyncio's reach the root logger (the screen)
    assert [record.getMessage() for record in caplog.records if record.name == "asyncio"] == []
    assert len(json.loads((tmp_path / "needle.json").read_text())) == 1


def test_an_abandoned_task_s_exception_goes_to_the_library_log(capsys, caplog, library_file):
    """What orbax leaves when one of several reads fails: a failed asyncio task whose exception nobody asks for."""

    async def fail():
        raise ValueError("a read cut short")

    library_log.install()
    loop = asyncio.new_event_loop()
    task = loop.create_task(fail())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    del task
    gc.collect()
    assert capsys.readouterr().err == ""
    assert [record.name for record in caplog.records] == []
    logged = library_file.read_text()
    assert "Task exception was never retrieved" in logged and "ValueError: a read cut short" in logged


INTERRUPTED = """
import runpy, sys, time
from train.data import haystack
def waiting(*args, **kwargs):  # the grid, long enough for Ctrl-C
    print("grid started", flush=True)
    time.sleep(120)
haystack.needle_grid = waiting
runpy.run_module("train.evaluate", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_ends_it_in_one_line(run, tmp_path):
    command = [sys.executable, "-c", INTERRUPTED, str(run), *GRID, "--out", str(tmp_path)]
    process = subprocess.Popen(command, cwd=tiny_run.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = process.stdout.readline()
    process.send_signal(signal.SIGINT)
    err = process.communicate(timeout=60)[1]
    assert started == "grid started\n", err
    assert process.returncode == 128 + signal.SIGINT, err
    assert [line for line in err.splitlines() if line.startswith("error")] == [
        f"error: stopped by Ctrl-C before the evaluation of {run} finished"
    ], err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["train", "train.evaluate", "train.hf"])
def test_ctrl_c_while_a_command_starts_is_one_line(command, tmp_path):
    """Its imports take seconds: Ctrl-C then ends it in one line, exit status 130, before it has written anything."""
    process = subprocess.Popen(
        [sys.executable, "-m", command, str(tmp_path / "missing")],
        cwd=tiny_run.REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    maps = pathlib.Path(f"/proc/{process.pid}/maps")
    deadline = time.monotonic() + 30
    while "_multiarray_umath" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.01)  # until numpy is loaded: the command's own imports are under way
    process.send_signal(signal.SIGINT)
    err = process.communicate(timeout=60)[1]
    assert process.returncode == 128 + signal.SIGINT, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: stopped by Ctrl-C"), err
