"""Errors that stop a command with a message instead of a traceback, and the way out after one."""

import os
import sys


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the run stops without saving the bad state."""


class DataError(ValueError):
    """The configured data cannot be read or holds no documents (names the file or setting and what is wrong)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: none can be read, or it holds another structure than the run (names which)."""


class OutputError(RuntimeError):
    """A command's output cannot be written (a full or read-only disk); what was there before is left as it was."""


def leave(code: int) -> int:
    """`code`, or for a failed command the exit now with `code`, its output flushed: on the way out JAX's shutdown
    waits for peers that may be gone, and orbax's and TensorStore's threads may still run (and crash the exit)."""
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
