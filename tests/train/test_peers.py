"""A dead or hung peer of a multi-process run: the watchdog's verdicts on a fake key-value store and clock (a
silent peer, one that failed, one that finished, a hung step, an unreachable coordinator, the step to resume
from), and (slow) two processes where one is killed (-9): the other stops within --peer-timeout with one line
naming it and the step to resume from, and exit status PEER_LOST."""

import os
import pathlib
import random
import subprocess
import sys
import time

import pytest

from tests.train.tiny_run import REPO, SMALL, TINY
from train.__main__ import main
from train.process import peers


class Store:
    """The coordination service's key-value store, in a dict; `down` makes every call fail."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        return [(key, value) for key, value in self.values.items() if key.startswith(prefix)]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def watchdogs(count: int, checkpoints=None, step_timeout=100.0):
    store, clock = Store(), Clock()
    timeouts = peers.Timeouts(peer=10.0, step=step_timeout, interval=1.0)
    return store, clock, [peers.Watchdog(store, i, count, timeouts, checkpoints, clock) for i in range(count)]


def look_all(clock, dogs, seconds, skip=()):
    """Every watchdog but `skip` looks once a second for `seconds`; the lines they would stop with."""
    lines = {}
    for _ in range(int(seconds)):
        clock.now += 1.0
        for dog in dogs:
            if dog.process not in skip and (line := dog.look()):
                lines[dog.process] = line
    return lines


def test_a_silent_peer_is_named_once_its_heartbeat_is_older_than_the_timeout(tmp_path):
    assert "No checkpoint is saved yet" in peers.resume_hint(tmp_path / "checkpoints")
    (tmp_path / "40").mkdir()
    (tmp_path / "60.orbax-checkpoint-tmp").mkdir()  # a save in progress is not a checkpoint
    _store, clock, dogs = watchdogs(3, tmp_path)
    assert look_all(clock, dogs, 30) == {}
    lines = look_all(clock, dogs, 10, skip={2})
    assert lines == {}  # 10 s of silence is not yet more than the timeout
    lines = look_all(clock, dogs, 2, skip={2})
    assert set(lines) == {0, 1}
    assert lines[1].startswith("error: process 2 of 3 stopped (no heartbeat for 11 s); process 1 stops too.")
    assert lines[1].endswith(f"to resume from step 40 ({tmp_path})")


def test_a_finished_peer_is_quiet_and_a_failed_one_is_named_at_once():
    _store, clock, dogs = watchdogs(2)
    look_all(clock, dogs, 2)
    dogs[1].close()
    assert look_all(clock, dogs, 60, skip={1}) == {}
    dogs[1].close(peers.FAILED)
    line = dogs[0].look()
    assert "process 1 of 2 stopped on an error (see its log)" in line
    assert "No checkpoint is saved yet" in line


def test_a_step_that_never_finishes_names_the_processes_behind():
    _store, clock, dogs = watchdogs(3)
    for dog in dogs:
        dog.finished(5)
    look_all(clock, dogs, 1)
    dogs[0].finished(6)
    dogs[2].finished(6)  # process 1 never finishes step 6: 0 and 2 wait in its collective
    assert look_all(clock, dogs, 99) == {}
    lines = look_all(clock, dogs, 2)
    assert "error: process 1 hung at step 5 (no step finished for 101 s); process 0 stops too." in lines[0]
    assert "this process hung after step 5 while others finished step 6" in lines[1]
    for dog in dogs:
        dog.finished(7)
    assert look_all(clock, dogs, 1000) == {}  # all at one step: a long step of every process (an evaluation)


def test_no_step_timeout_before_the_first_step_or_when_off():
    _store, clock, dogs = watchdogs(2, step_timeout=0.0)
    dogs[0].finished(1)
    assert look_all(clock, dogs, 1000) == {}
    _store, clock, dogs = watchdogs(2)
    assert look_all(clock, dogs, 1000) == {}  # compiling the first step takes what it takes


def test_an_unreachable_store_means_the_coordinator_stopped():
    store, _clock, dogs = watchdogs(2)
    store.down = True
    assert dogs[1].look().startswith("error: process 0 of 2 (the coordinator) cannot be reached (UNAVAILABLE")


def test_jax_heartbeat_timeout_comes_after_the_watchdogs():
    timeouts = peers.Timeouts(peer=10.0, interval=2.0)
    assert timeouts.jax_heartbeat_timeout() > timeouts.peer + 2 * timeouts.interval


@pytest.mark.parametrize("flag", ["--peer-timeout=0", "--step-timeout=-1", "--peer-timeout=soon"])
def test_timeouts_must_be_seconds(flag, capsys):
    with pytest.raises(SystemExit):
        main([str(TINY), "--distributed", flag])
    assert "seconds" in capsys.readouterr().err


def _start(output: pathlib.Path, port: int) -> list[subprocess.Popen]:
    """Two `python -m train --distributed` processes of 4 CPU devices each, --peer-timeout 10."""
    args = [str(TINY), *SMALL, "train.steps=1000", "checkpoint.every_steps=2", "train.sample_tokens=0"]
    cluster = ["--distributed", f"--coordinator=127.0.0.1:{port}", "--num-processes=2", "--peer-timeout=10"]
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS="--xla_force_host_platform_device_count=4")
    return [
        subprocess.Popen(
            [sys.executable, "-m", "train", *cluster, f"--process-id={i}", *args, f"train.output_dir={output}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_the_survivor_of_a_killed_peer_stops_with_one_line(tmp_path, killed):
    runs = _start(tmp_path, random.randint(20000, 40000))
    deadline = time.monotonic() + 300
    while not (tmp_path / "checkpoints" / "2").is_dir():
        assert all(run.poll() is None for run in runs) and time.monotonic() < deadline, runs[0].communicate()[0]
        time.sleep(0.1)
    runs[killed].kill()
    killed_at = time.monotonic()
    survivor = runs[1 - killed]
    out, _ = survivor.communicate(timeout=60)
    assert survivor.returncode == peers.PEER_LOST, out[-3000:]
    assert time.monotonic() - killed_at < 10 + 15  # --peer-timeout, two looks, the exit
    line = out.strip().splitlines()[-1]
    who = f"process {killed} of 2 stopped" if killed else "process 0 of 2 (the coordinator, 127.0.0."
    assert line.startswith(f"error: {who}") and f"process {1 - killed} stops too" in line, out[-3000:]
    assert "rerun every process with the same command to resume from step" in line.lower()
    runs[killed].communicate()
