"""Hung steps: the Gated DeltaNet hybrid trains through the command on 8 CPU devices (its chunk inverse is no
triangular solve, whose XLA:CPU kernel waited on the thread pool the devices' threads held), and a single-process
run whose step waits past --step-timeout ends with one line and exit status 5 (train/process/stall.py)."""

import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel.kernels.gated_delta import unit_lower_inverse
from tests.train.tiny_run import REPO
from train.process.peers import PEER_LOST
from train.process.stall import StallWatch

QUICK = [
    "train.steps=2",
    "train.log_every_steps=1",
    "train.eval_batches=0",
    "train.sample_tokens=0",
    "checkpoint.enabled=false",
    "data.seq_len=128",
]


def test_the_hybrid_trains_through_the_command_on_8_devices(tmp_path):
    """fsdp 2 x ring 4: the parameters sharded and the row split, each of which hung alone."""
    mesh = ["mesh.fsdp=2", "mesh.context=4", "parallel.context_strategy=ring"]
    command = [
        sys.executable,
        "-m",
        "train",
        "configs/qwen3_5-tiny.yaml",
        *QUICK,
        *mesh,
        f"train.output_dir={tmp_path}",
    ]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the hybrid's step hung: no exit in {expired.timeout} s; stderr:\n{expired.stderr}")
    assert done.returncode == 0, done.stderr
    assert re.search(r"step\s+2 loss \d", done.stderr), done.stderr


def test_the_chunk_inverse_is_matmuls_equal_to_a_triangular_solve():
    strict = np.tril(np.random.default_rng(0).normal(size=(3, 64, 64)) / 8, -1)
    inverse = jax.jit(unit_lower_inverse)(jnp.asarray(strict))
    expected = np.linalg.inv(np.eye(64) + strict)
    np.testing.assert_allclose(inverse, expected, rtol=1e-4, atol=1e-5)
    assert "triangular" not in jax.jit(unit_lower_inverse).lower(jnp.asarray(strict)).as_text()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_wait_past_the_timeout_is_a_hang_named_by_its_step(tmp_path):
    (tmp_path / "20").mkdir()
    clock = Clock()
    watch = StallWatch(300.0, tmp_path, clock=clock)
    with watch.waiting("step 23"):
        clock.now = 300.0
        assert watch.look() is None
        clock.now = 301.0
        line = watch.look()
    assert line == (
        "error: step 23 made no progress for 301 s (--step-timeout 300): the devices wait inside the compiled step, "
        f"a hang; stopped without saving. Rerun the same command to resume from step 20 ({tmp_path})"
    )
    clock.now = 1000.0
    assert watch.look() is None  # no wait: a compile, a save or the host's work is never a hang


def test_the_watch_ends_the_process_with_status_5(tmp_path):
    ended = []
    done = threading.Event()
    watch = StallWatch(0.2, None, end=lambda status: (ended.append(status), done.set()))
    watch.start(interval=0.05)
    time.sleep(0.4)  # not waiting: nothing happens
    assert not ended
    with watch.waiting("step 1"):
        assert done.wait(5.0)
    watch.close()
    assert ended == [PEER_LOST]
