"""Training: the commands (`python -m train`, `python -m train.evaluate`, `python -m train.hf`), the loop (loop,
trainer, divergence, step, optimizer, state, metrics, sample, needle), errors, and the rooms, each a package with one
concern: config/ (a run's YAML), data/ (documents to batches), checkpoints/ (checkpoints and run directories),
planning/ (the parallelism, memory and speed of a run before it runs) and process/ (the processes of a run and how they
end)."""

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
