"""Training: config, data, optimizer, step, loop, checkpoints, metrics and the `python -m train` CLI."""

import sys

try:
    import parallel  # noqa: F401  first: parallel/compat.py refuses a JAX outside the supported range
except ImportError as error:
    if type(error).__name__ != "UnsupportedJax":
        raise
    print(f"error: {error}", file=sys.stderr)  # the commands stop with one line, not a traceback
    sys.exit(2)
