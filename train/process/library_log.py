"""What the checkpointing libraries report goes to a file, not the screen: orbax's and absl's log records, asyncio's
(a read orbax abandoned: "Task exception was never retrieved") and the exceptions Python can only print
("Exception ignored in ...", TensorStore's failed reads), which a damaged checkpoint or a failed save produce by the
hundred. The file is RUN/library.log once a run has its directory (`move_to`), before that and for the other
commands longctx-<pid>.log in the system's temp directory, made at the first message. The screen keeps the
project's own lines, which name the file (`mention`) when it holds something.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import sys
import tempfile
import traceback

LIBRARIES = ("absl", "asyncio", "orbax", "tensorstore")
FILE_NAME = "library.log"


class LibraryLog(logging.Handler):
    """Appends records (with their tracebacks) and unraisable exceptions to `path`, opened at the first one."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.before_run = pathlib.Path(tempfile.gettempdir()) / f"longctx-{os.getpid()}.log"
        self.path, self.written = self.before_run, False

    def write(self, text: str) -> None:
        with contextlib.suppress(OSError):  # a full or read-only disk: the message is lost, not the run
            with open(self.path, "a") as file:
                file.write(text if text.endswith("\n") else text + "\n")
            self.written = True

    def emit(self, record: logging.LogRecord) -> None:
        self.write(self.format(record))

    def unraisable(self, unraisable) -> None:
        """sys.unraisablehook: an exception raised where Python cannot raise it (a finalizer, a callback)."""
        header = unraisable.err_msg or "Exception ignored in"
        lines = traceback.format_exception(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)
        self.write(f"{header}: {unraisable.object!r}\n{''.join(lines)}")

    def move_to(self, directory: pathlib.Path, process: int) -> None:
        """Writes from now on to directory/library.log (library.I.log for process I > 0); what the temp file holds
        (this process's messages from before the run had its directory) goes there first."""
        target = directory / (FILE_NAME if process == 0 else f"library.{process}.log")
        moved = False
        if self.written and self.path == self.before_run:
            with contextlib.suppress(OSError):
                with open(target, "a") as file:
                    file.write(self.before_run.read_text())
                self.before_run.unlink()
                moved = True
        self.path, self.written = target, moved


_log = LibraryLog()


def install() -> None:
    """Sends the LIBRARIES' log records and unraisable exceptions to the library log, from now on."""
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        logger.handlers = [_log]
        logger.propagate = False
    sys.unraisablehook = _log.unraisable


def move_to(directory: str | pathlib.Path, process: int = 0) -> None:
    """The library log is in `directory` from now on (a run's directory, once made; see LibraryLog.move_to)."""
    _log.move_to(pathlib.Path(directory), process)


def note(text: str) -> None:
    """Writes one message of the project's own to the library log (a failure beside the one the screen shows)."""
    _log.write(text)


def mention() -> str:
    """' (library messages: PATH)' when the library log holds something, else ''."""
    return f" (library messages: {_log.path})" if _log.written else ""
