"""The processes of a run and how they end: the environment the commands set before JAX starts (environment.py),
what the checkpointing libraries log (library_log.py), the start-up of a multi-process cluster (distributed.py),
peers that watch each other (peers.py), signals (stop.py) and hung steps (stall.py).

It imports no model, layer or data module itself (import-linter checks; the config it reads names the model's
architecture), and of the rest of train/ only the config."""
