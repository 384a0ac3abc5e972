"""SIGTERM while training (train/process/stop.py), in a process whose main thread never reaches a step boundary (it
waits, as in a collective whose peer never comes): a second signal, or the grace after the first, ends it at once with
one line naming the checkpoint to resume from and exit status 128 + SIGTERM, as does the first once the steps are over;
a first signal the loop has heard waits for its save, however long."""

import signal
import subprocess
import sys

import pytest

from tests.train.tiny_run import REPO

BLOCKED = """
import os, pathlib, signal, sys, threading, time
from train.process import stop
stop.GRACE_S = 2.0
checkpoints = pathlib.Path(sys.argv[1])
(checkpoints / "4").mkdir(parents=True)
watch = stop.Stop(checkpoints)
if sys.argv[3] == "finishing":
    watch.finishing()  # the steps are over: the last save, the sample
for _ in range(int(sys.argv[2])):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
if sys.argv[3] == "heard":
    assert watch.requested() == signal.SIGTERM  # the loop saves: no grace ends it
    time.sleep(3 * stop.GRACE_S)
    sys.exit(0)
threading.Event().wait()  # blocked: signals are not handled in the main thread
"""


@pytest.mark.parametrize("signals, loop", [(2, "blocked"), (1, "blocked"), (1, "heard"), (1, "finishing")])
def test_a_blocked_run_ends_at_a_second_signal_or_after_the_grace(tmp_path, signals, loop):
    command = [sys.executable, "-c", BLOCKED, str(tmp_path), str(signals), loop]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)
    if loop == "heard":
        assert (done.returncode, done.stderr) == (0, "")
        return
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    why = {
        "blocked": "stopped by a second signal" if signals == 2 else "no step finished within 2 s of signal 15",
        "finishing": "stopped by signal 15 while the run was finishing",
    }[loop]
    assert done.stderr.strip() == (
        f"error: {why} before a checkpoint could be saved. Rerun every process with the same command to resume "
        f"from step 4 ({tmp_path})"
    )
