"""Errors that stop a run with a message instead of a traceback."""


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the run stops without saving the bad state."""
