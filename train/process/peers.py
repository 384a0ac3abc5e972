"""Watching the other processes of a `--distributed` run: a dead or hung peer stops the survivors within a
bounded time, each with one line naming the process and the step to resume from, and exit status PEER_LOST.

Every process runs a daemon thread that, every `Timeouts.interval` seconds, publishes a heartbeat and its last
finished step in the cluster's key-value store (JAX's coordination service, held by process 0) and reads the
others'. A peer whose heartbeat has not changed for `Timeouts.peer` seconds has stopped (killed, crashed, its
host gone); the store failing to answer means process 0 has; a peer that failed on its own says so (FAILED).
When this process has finished no step for `Timeouts.step` seconds after its first and the processes' steps
differ, those behind are hung (equal steps are a long step of all, e.g. an evaluation, not a hang).

JAX's own heartbeat check is given a longer timeout (`jax_heartbeat_timeout`), so this one speaks first. A
collective that fails in the main thread (a peer's connection reset) waits for the watchdog's verdict before
its own error is reported (`reporting`). Process 0's death is the one XLA reports first, by aborting every other
process at once: `watch` turns that abort into the same kind of line.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import jax

from parallel import compat

PEER_LOST = 5  # exit status of a process stopped because a peer stopped or hung
PREFIX = "longctx/peers/"
DONE = -1  # the beat a process publishes when it has finished: its silence after that is not a failure
FAILED = -2  # the beat a process publishes when it stops on an error of its own (its log says which)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds: `peer` without a heartbeat means a peer stopped; `step` without a finished step (after the first;
    0 = never) means the processes behind are hung; `interval` between two looks."""

    peer: float = 60.0
    step: float = 1800.0
    interval: float = 2.0

    def jax_heartbeat_timeout(self) -> int:
        """JAX's heartbeat timeout: past `peer` and two looks, so that the watchdog's line comes first."""
        return int(self.peer + 2 * self.interval + 30)


def resume_hint(checkpoints: pathlib.Path | None, who: str = "every process with ") -> str:
    """How to resume: from the newest complete checkpoint under `checkpoints`, if any; `who` reruns."""
    found = checkpoints.iterdir() if checkpoints and checkpoints.is_dir() else ()
    steps = [int(path.name) for path in found if path.name.isdigit()]
    if not steps:  # complete checkpoints only: orbax writes a step under a temporary name and renames it
        return f"No checkpoint is saved yet: rerunning {who}the same command starts over"
    return f"Rerun {who}the same command to resume from step {max(steps)} ({checkpoints})"


class Watchdog:
    """One look at a time (`look`), on a daemon thread once started; `finished(step)` is called by the loop."""

    def __init__(
        self,
        store,
        process: int,
        count: int,
        timeouts: Timeouts,
        checkpoints: pathlib.Path | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.process, self.count = store, process, count
        self.timeouts, self.checkpoints, self.clock = timeouts, checkpoints, clock
        self.beat, self.step = 0, 0
        self.step_time: float | None = None  # when this process last finished a step (None: before the first)
        self.seen: dict[int, tuple[int, float]] = {}  # peer -> (its last beat, when it changed)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def finished(self, step: int) -> None:
        self.step, self.step_time = step, self.clock()

    def look(self) -> str | None:
        """Publishes this process's heartbeat and step, reads the others'; the line to stop with, or None."""
        now = self.clock()
        self.beat += 1
        try:
            self.store.key_value_set(f"{PREFIX}{self.process}", f"{self.beat} {self.step}", allow_overwrite=True)
            published = dict(self.store.key_value_dir_get(PREFIX))
        except Exception as error:  # noqa: BLE001 - the store is process 0's: any failure means it is unreachable
            cause = str(error).splitlines()[0] if str(error) else type(error).__name__
            return self.line(f"process 0 of {self.count} (the coordinator) cannot be reached ({cause})")
        steps = {self.process: self.step}
        for peer in range(self.count):
            if peer == self.process:
                continue
            beat, steps[peer] = map(int, published.get(f"{PREFIX}{peer}", "0 0").split())
            if beat == DONE:
                continue
            if beat == FAILED:
                return self.line(f"process {peer} of {self.count} stopped on an error (see its log)")
            last = self.seen.get(peer)
            if last is None or last[0] != beat:
                self.seen[peer] = (beat, now)
            elif now - last[1] > self.timeouts.peer:
                return self.line(f"process {peer} of {self.count} stopped (no heartbeat for {now - last[1]:.0f} s)")
        waited = now - self.step_time if self.step_time is not None else 0.0
        if self.timeouts.step and waited > self.timeouts.step and len(set(steps.values())) > 1:
            return self.line(f"{self._hung(steps)} (no step finished for {waited:.0f} s)")
        return None

    def _hung(self, steps: dict[int, int]) -> str:
        """Who is hung, from every process's last finished step (they differ): those behind this one, else this
        one."""
        behind = [peer for peer, step in steps.items() if step < self.step]
        if behind:
            return f"process {', '.join(map(str, behind))} hung at step {min(steps[p] for p in behind)}"
        return f"this process hung after step {self.step} while others finished step {max(steps.values())}"

    def line(self, what: str) -> str:
        return f"error: {what}; process {self.process} stops too. {resume_hint(self.checkpoints)}"

    def stop(self, line: str) -> None:
        """Writes `line` and ends the process with PEER_LOST: the main thread waits on a collective that will never
        complete. Once only, and not after close()."""
        with self.lock:
            if self.stopping.is_set():
                return
            print(line, file=sys.stderr, flush=True)
            os._exit(PEER_LOST)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._watch, name="peer-watchdog", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stopping.wait(self.timeouts.interval):
            line = self.look()
            if line:
                self.stop(line)

    def close(self, beat: int = DONE) -> None:
        """Stops watching (no look in flight once it returns: JAX's exit-time shutdown may follow) and tells the
        peers this process is done (its silence is then not a failure) or FAILED."""
        with self.lock:
            self.stopping.set()
        if self.thread not in (None, threading.current_thread()):
            self.thread.join()
        with contextlib.suppress(Exception):  # the run is over: a coordinator already gone has nothing to tell
            self.store.key_value_set(f"{PREFIX}{self.process}", f"{beat} {self.step}", allow_overwrite=True)

    def failed(self, error: BaseException) -> None:
        """The main thread stopped on `error`. A runtime (collective) error may be a peer's death: the watchdog
        gets the time to name it (and end the process) first. Then the peers are told this process failed."""
        if isinstance(error, jax.errors.JaxRuntimeError):
            self.stopping.wait(self.timeouts.peer + 2 * self.timeouts.interval)
        self.close(FAILED)


_active: Watchdog | None = None


def coordinator_down(address: str) -> bool:
    """Whether nothing listens at `address` (host:port) any more."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


def _aborting(signum: int) -> None:
    """SIGABRT from XLA (it has written why): the watchdog's line instead of a core dump, and PEER_LOST."""
    del signum
    coordinator = compat.distributed_state().coordinator_address
    if _active.process and coordinator and coordinator_down(coordinator):
        what = f"process 0 of {_active.count} (the coordinator, {coordinator}) stopped"
    else:
        what = "XLA stopped this process of the cluster (its message above says why)"
    print(_active.line(what), file=sys.stderr, flush=True)
    os._exit(PEER_LOST)


_ON_ABORT = ctypes.CFUNCTYPE(None, ctypes.c_int)(_aborting)  # kept alive: the C library holds only its address


def watch(watchdog: Watchdog) -> None:
    """Starts `watchdog` as the one `step_finished` reports to, and the handler of XLA's abort: XLA aborts every
    process as soon as process 0 is gone, before a heartbeat can be missed."""
    global _active
    _active = watchdog
    watchdog.start()
    _on_abort(_ON_ABORT)


def _on_abort(handler) -> None:
    """Installs `handler` for SIGABRT in the C library (None: the default, abort)."""
    libc = ctypes.CDLL(None)
    libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p
    libc.signal(signal.SIGABRT, None if handler is None else ctypes.cast(handler, ctypes.c_void_p))


def step_finished(step: int) -> None:
    """Tells the running watchdog (if any: multi-process runs) that this process has finished `step`."""
    if _active is not None:
        _active.finished(step)


@contextlib.contextmanager
def reporting():
    """Around the run: on success the peers are told this process is done; on an error (not a signal's stop),
    that it failed, once the watchdog has had the time to name a stopped peer as the cause."""
    try:
        yield
    except SystemExit:
        _finish(DONE)
        raise
    except BaseException as error:
        if _active is not None:
            _active.failed(error)
        raise
    _finish(DONE)


def stop_watching() -> None:
    """The run ends before it began (every process refuses alike): the watchdog stops, the peers told DONE."""
    _finish(DONE)


def _finish(beat: int) -> None:
    """The run is over: the watchdog stops and an abort is XLA's again (JAX's exit-time shutdown is not a peer's
    death, whatever it logs)."""
    if _active is not None:
        _active.close(beat)
        _on_abort(None)
