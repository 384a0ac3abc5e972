"""Writing a directory so that no interruption leaves it half written: the new contents go into a fresh sibling,
which then takes the directory's place in one step (Linux's renameat2 RENAME_EXCHANGE swaps the two; elsewhere two
renames, with an instant where the path is missing). What it replaced is removed after the swap; siblings left by
an interrupted write are removed by the next one."""

from __future__ import annotations

import ctypes
import errno
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _staging_prefix(path: pathlib.Path) -> str:
    return f".{path.name}.writing-"


def replace_directory(path: str | pathlib.Path, write: Callable[[pathlib.Path], T]) -> T:
    """Runs write(fresh directory) and puts that directory at `path` in one step; returns what `write` returned.
    Until the swap `path` is as it was, whatever happens (an exception, a kill)."""
    path = pathlib.Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(f"{_staging_prefix(path)}*"):  # an interrupted write's
        shutil.rmtree(leftover, ignore_errors=True)
    stage = pathlib.Path(tempfile.mkdtemp(prefix=_staging_prefix(path), dir=path.parent))
    try:
        result = write(stage)
        stage.chmod(0o777 & ~umask())  # mkdtemp's 0700 -> what mkdir would have made
        if path.exists():
            _exchange(stage, path)  # stage now holds what `path` held
        else:
            stage.rename(path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return result


def umask() -> int:
    """The process's file mode creation mask (read by setting it and back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _exchange(a: pathlib.Path, b: pathlib.Path) -> None:
    """Swaps directories `a` and `b` atomically where the kernel can, else by two renames."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, bytes(a), _AT_FDCWD, bytes(b), _RENAME_EXCHANGE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(code, f"cannot swap {a} into place: {os.strerror(code)}", str(b))
    aside = a.with_name(f"{a.name}.old")
    b.rename(aside)
    a.rename(b)
    aside.rename(a)
