"""`data.source: retrieval`: synthetic needle-retrieval documents, each one haystack of train/data/haystack.py's
`build`.

A document is filler sentences with needles ("The special magic number for KEY is VALUE.") at random depths, then
the question and its answer: exactly the rows `python -m train.evaluate` scores, without the bos. Documents are
data.seq_len - 1 bytes, so with the byte tokenizer and the pipeline's bos and eos one document fills one row: the
training length is the length to evaluate at, and no needle is cut from its question. The filler is RULER's few
repeated sentences, learned within tens of steps, which leaves the random values as the only thing left to
predict and retrieval as the only way to predict them: a two-layer byte model learns it in a few hundred steps
on CPU. Documents shorter than MULTI_NEEDLE_BYTES are single-needle (four needles
do not fit with filler around them); longer ones are single, multi_key or multi_value at random.

Document `i` is drawn from its own generator (SEED, i), so any document is built alone, the same every time.
"""

from __future__ import annotations

import numpy as np

from train.data.haystack import TASKS, build
from train.data.tokenizer import ByteTokenizer
from train.errors import DataError

DOCUMENTS = 100_000
SEED = 0
MIN_SEQ_LEN = 128  # a single needle, its question and answer, and some filler
MULTI_NEEDLE_BYTES = 511  # from this length on, multi_key and multi_value documents too
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


class _Text(ByteTokenizer):
    """UTF-8 bytes without a bos, so that a haystack's tokens are a document's text."""

    bos_id = None


_TEXT = _Text()


class RetrievalSource:
    """`count` needle-retrieval documents of `seq_len` - 1 bytes each; source[i] builds document i."""

    def __init__(self, seq_len: int, count: int = DOCUMENTS):
        if seq_len < MIN_SEQ_LEN:
            raise DataError(f"data.source='retrieval' needs data.seq_len >= {MIN_SEQ_LEN}; got data.seq_len={seq_len}")
        self.length = seq_len - 1
        self.count = count
        self.tasks = TASKS if self.length >= MULTI_NEEDLE_BYTES else ("single",)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < self.count:
            raise IndexError(f"document {index} out of range for {self.count} retrieval documents")
        rng = np.random.default_rng((SEED, index))
        task = self.tasks[rng.integers(len(self.tasks))]
        haystack = build(task, _TEXT.encode(FILLER), _TEXT, self.length, rng.uniform(), rng)
        return _TEXT.decode(haystack.tokens)

    def sizes(self) -> np.ndarray:
        """[count] int64: every document is `length` bytes (ASCII)."""
        return np.full(self.count, self.length, np.int64)
