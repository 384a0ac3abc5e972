"""One run per output directory: process 0 holds an exclusive lock on OUTPUT/.lock while the run uses it.

The operating system drops the lock when the process ends, however it ends (kill -9 included), so a killed run
never leaves its directory locked; the file keeps the holder's process id for the message a second run gets."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib

from train.config import ConfigError

LOCK_FILE = ".lock"


def _cannot_write(output: pathlib.Path, error: OSError) -> ConfigError:
    return ConfigError(
        f"train.output_dir={str(output)!r} cannot be written ({type(error).__name__}: {error.strerror or error} "
        f"for {error.filename or output}); choose a train.output_dir this user can create and write"
    )


def make_run_directory(output: pathlib.Path) -> None:
    """Creates OUTPUT (and its parents) if needed; ConfigError naming it when that is not possible."""
    try:
        output.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _cannot_write(output, error) from None


@contextlib.contextmanager
def run_directory_lock(output: pathlib.Path):
    """Holds OUTPUT/.lock for the block; a second holder gets a ConfigError naming the directory and the process,
    and a directory where the lock cannot be written one naming it."""
    try:
        fd = os.open(output / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise _cannot_write(output, error) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise ConfigError(
                f"train.output_dir={str(output)!r} is in use by another run (process {holder}); wait for it to "
                f"finish or choose another train.output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
