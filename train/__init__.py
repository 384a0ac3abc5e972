"""Training: config, data, optimizer, step, loop, checkpoints, metrics and the `python -m train` CLI."""

import os
import signal
import sys


def _interrupted(signum, _frame) -> None:
    """Ctrl-C in a command that has no stop of its own (yet): one line and exit 128 + the signal, not a traceback."""
    print("error: stopped by Ctrl-C", file=sys.stderr, flush=True)
    os._exit(128 + signum)


if sys.argv[:1] == ["-m"]:  # a command (python -m train...) is starting: its imports alone take seconds
    signal.signal(signal.SIGINT, _interrupted)

try:
    import parallel  # noqa: F401  first: parallel/compat.py refuses a JAX outside the supported range
except ImportError as error:
    if type(error).__name__ != "UnsupportedJax":
        raise
    print(f"error: {error}", file=sys.stderr)  # the commands stop with one line, not a traceback
    sys.exit(2)
