"""SIGTERM / SIGINT while training. The first is remembered, and the loop saves a checkpoint at the next step
boundary and stops. A process whose main thread does not reach one within GRACE_S (it is blocked: a collective
waiting for a peer that will never come) or that gets a second signal ends at once, with one line naming the newest
complete checkpoint and exit status 128 + the signal; so does one signalled once the steps are over (`finishing`:
the last save, the sample), when no step boundary is left to stop at.

Python runs a signal's handler only when the main thread runs Python, so a thread reads the signals from the
interpreter's wakeup file descriptor, where each one is written as it arrives."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import sys
import threading

from train.process.peers import resume_hint

SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 120.0  # from the first signal to the step boundary that saves


class Stop:
    """`requested()`: the first SIGTERM / SIGINT received, or None; `restore()` gives the signals back."""

    def __init__(self, checkpoints: pathlib.Path | None):
        self.signal: int | None = None
        self.checkpoints, self.grace_s = checkpoints, GRACE_S
        self.heard = threading.Event()  # the loop has seen the signal: it saves and stops
        self.finished = False  # the steps are over
        self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.previous_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="signals", daemon=True).start()

    def _handle(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal = signum

    def requested(self) -> int | None:
        """The signal to stop for (the loop then saves and stops), or None."""
        if self.signal is not None:
            self.heard.set()
        return self.signal

    def finishing(self) -> None:
        """The steps are over: a signal from now on (not one the loop has heard) ends the process at once."""
        self.finished = True

    def _watch(self) -> None:
        """Ends the process at a second signal, or when the loop has not heard the first within grace_s; returns
        when `restore` closes the writer."""
        received = []
        while True:
            self.reader.settimeout(self.grace_s if received and not self.heard.is_set() else None)
            try:
                data = self.reader.recv(64)
            except TimeoutError:
                if not self.heard.is_set():
                    self._end(received[0], f"no step finished within {self.grace_s:.0f} s of signal {received[0]}")
                continue
            if not data:
                break
            received += [signum for signum in data if signum in SIGNALS]
            if len(received) >= 2:
                self._end(received[1], "stopped by a second signal")
            if received and self.finished and not self.heard.is_set():
                self._end(received[0], f"stopped by signal {received[0]} while the run was finishing")
        self.reader.close()

    def _end(self, signum: int, why: str) -> None:
        print(
            f"error: {why} before a checkpoint could be saved. {resume_hint(self.checkpoints)}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)

    def restore(self) -> None:
        signal.set_wakeup_fd(self.previous_fd)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.writer.close()  # the reader sees the end and its thread returns
