"""A hung step in a single-process run: the loop waits on the devices for a step's results (`waiting`), and a
wait past the timeout ends the process with one line naming the step and the checkpoint to resume from, exit
status PEER_LOST, as a hung peer does in a `--distributed` run (train/process/peers.py).

Only waits on results count: compiling (a step's first dispatch, the first evaluation) is no wait, so the timeout
starts after the compile. A daemon thread looks every `interval` seconds.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable

from train.process.peers import PEER_LOST, resume_hint


class StallWatch:
    """Ends the process (`end(PEER_LOST)`) when one `waiting` lasts more than `timeout` seconds."""

    def __init__(
        self,
        timeout: float,
        checkpoints: pathlib.Path | None,
        clock: Callable[[], float] = time.monotonic,
        end: Callable[[int], None] = os._exit,  # the process's exit; a stand-in in tests
    ):
        self.timeout, self.checkpoints, self.clock, self.end = timeout, checkpoints, clock, end
        self.since: float | None = None  # when the current wait began (None: not waiting)
        self.what = ""
        self.stopping = threading.Event()

    @contextlib.contextmanager
    def waiting(self, what: str):
        """Around a wait on the devices for `what` (e.g. "step 7")."""
        self.since, self.what = self.clock(), what
        try:
            yield
        finally:
            self.since = None

    def look(self) -> str | None:
        """The line to stop with when the current wait has lasted past the timeout, else None."""
        since = self.since
        if since is None or self.clock() - since <= self.timeout:
            return None
        return (
            f"error: {self.what} made no progress for {self.clock() - since:.0f} s (--step-timeout {self.timeout:g}): "
            f"the devices wait inside the compiled step, a hang; stopped without saving. "
            f"{resume_hint(self.checkpoints, who='')}"
        )

    def start(self, interval: float) -> None:
        threading.Thread(target=self._watch, args=(interval,), name="stall-watch", daemon=True).start()

    def _watch(self, interval: float) -> None:
        while not self.stopping.wait(interval):
            line = self.look()
            if line:
                print(line, file=sys.stderr, flush=True)
                self.end(PEER_LOST)
                return

    def close(self) -> None:
        self.stopping.set()


_active: StallWatch | None = None


@contextlib.contextmanager
def watching(timeout: float, checkpoints: pathlib.Path | None):
    """Around a single-process run: its waits are watched (timeout 0: never)."""
    global _active
    if not timeout:
        yield
        return
    _active = StallWatch(timeout, checkpoints)
    _active.start(interval=min(2.0, timeout / 4))
    try:
        yield
    finally:
        _active.close()
        _active = None


def waiting(what: str):
    """The active watch's `waiting(what)`, or nothing to watch (no watch: tests, `--distributed` runs)."""
    return _active.waiting(what) if _active is not None else contextlib.nullcontext()
