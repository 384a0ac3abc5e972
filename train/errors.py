"""Errors that stop a run with a message instead of a traceback."""


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the run stops without saving the bad state."""


class DataError(ValueError):
    """The configured data cannot be read or holds no documents (names the file or setting and what is wrong)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: none can be read, or it holds another structure than the run (names which)."""
