"""Planning a run before it runs: the parallelism a run traces with (run_parallelism.py), the per-device memory of the
compiled step (memory.py), sizes as people write them (sizes.py), model FLOPs and the devices' peak rates
(flops.py), and the speed estimate (speed.py) from the compiled program's text (hlo.py).

It compiles the real train step (the loop's step, state and optimizer) but reads no data: it imports no data library
(grain, pyarrow, tokenizers), checkpoints or processes (import-linter checks), and of train/data/ only the batch's
fields."""
