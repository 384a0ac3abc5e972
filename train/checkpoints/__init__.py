"""Checkpoints and run directories: orbax checkpoints of a run's state and how they are read back (checkpoint.py),
whether a checkpoint or an import holds the run's model (architecture.py), the Hugging Face files a model came with
(origin.py), and one run per output directory (lock.py).

It imports no data library and nothing of the loop; of the rest of train/ only the config, train/errors.py and
planning's sizes."""
