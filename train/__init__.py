"""Training: config, data, optimizer, step, loop, checkpoints, metrics and the `python -m train` CLI."""
