"""SIGTERM when the main thread cannot reach a step boundary (here it waits forever after dispatching step 3, as in a
collective whose peer never comes): a second signal, or the grace after the first, ends the process at once with
one line naming the checkpoint to resume from and exit status 128 + SIGTERM."""

import signal
import subprocess
import sys
import time

import pytest

from tests.train.tiny_run import REPO, SMALL, TINY

STUCK_AT_STEP_3 = """
import runpy, sys, threading
from train import peers, stop
stop.GRACE_S = float(sys.argv.pop(1))
finished = peers.step_finished
def step_finished(step):
    finished(step)
    if step == 3:
        print("stuck", file=sys.stderr, flush=True)
        threading.Event().wait()
peers.step_finished = step_finished
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("train", run_name="__main__")
"""


@pytest.mark.parametrize("signals", [2, 1])
def test_a_blocked_run_ends_in_one_line_at_a_second_signal_or_after_the_grace(tmp_path, signals):
    overrides = ["train.steps=6", "checkpoint.every_steps=2", "train.sample_tokens=0", "train.eval_batches=0"]
    grace = 600 if signals == 2 else 3
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            STUCK_AT_STEP_3,
            str(grace),
            str(TINY),
            *SMALL,
            *overrides,
            f"train.output_dir={tmp_path}",
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    while "stuck" not in lines[-1:]:
        line = process.stderr.readline()
        assert line, "".join(lines)[-3000:]
        lines.append(line.strip())
    process.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert process.poll() is None  # the first waits for a step boundary that never comes
    if signals == 2:
        process.send_signal(signal.SIGTERM)
    rest = process.communicate(timeout=30)[1]
    assert process.returncode == 128 + signal.SIGTERM, rest[-3000:]
    why = "stopped by a second signal" if signals == 2 else f"no step finished within 3 s of signal {signal.SIGTERM}"
    assert rest.strip().splitlines()[-1] == (
        f"error: {why} before a checkpoint could be saved. Rerun every process with the same command to resume from "
        f"step 2 ({tmp_path / 'checkpoints'})"
    )
