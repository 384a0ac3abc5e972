"""What a batch holds: its arrays, each [rows, seq_len], and their dtypes (the pipeline yields them, the steps take
them); numpy only, so the step and the memory plan need no data library."""

import numpy as np

BATCH_FIELDS = {
    "tokens": np.int32,
    "targets": np.int32,
    "segment_ids": np.int32,
    "positions": np.int32,
    "loss_mask": np.float32,
}
