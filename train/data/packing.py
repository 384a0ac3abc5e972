"""Packing token chunks (train/data/token_stream.py) into rows of seq_len tokens.

A row is {"tokens", "targets", "segment_ids", "positions"}, int32 [seq_len] each: segment_ids 1, 2, ... per segment
of the row and 0 on padding (whose other fields are 0); positions count from each segment's first token, so a
document that goes on from an earlier row (no bos, one segment) starts the row at 0: its attention sees this row
only, and RoPE is relative, so an offset would change nothing but float32 angles, which lose precision at millions.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

PACKINGS = ("concat", "first_fit")
CHUNK_FIELDS = ("inputs", "targets", "positions")


def pack(chunks: grain.IterDataset, *, seq_len: int, packing: str, num_bins: int) -> grain.IterDataset:
    """Rows of `chunks` ({"inputs", "targets", "positions"}, int32 [n], n <= seq_len).

    concat: chunks are concatenated and split across rows (no padding until the stream ends); a segment starts
    where a span starts (position 0) and at the start of a row. first_fit: each chunk is a segment, first-fit into
    `num_bins` rows at a time, which are emitted in order and padded.
    """
    if packing == "concat":
        return _ConcatRows(chunks, seq_len)
    if packing == "first_fit":
        rows = grain.experimental.FirstFitPackIterDataset(
            chunks,
            length_struct=dict.fromkeys(CHUNK_FIELDS, seq_len),
            num_packing_bins=num_bins,
            shuffle_bins=False,
            meta_features=("positions",),  # packed and padded as they are, not renumbered
        )
        return rows.map(lambda row: _first_fit_row(row, seq_len))
    raise ValueError(f"data.packing={packing!r} is not allowed; choose one of {', '.join(PACKINGS)}")


def _first_fit_row(row: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """A packed row's fields; a piece's positions from 0 (pieces start at multiples of seq_len in their span)."""
    return {
        "tokens": row["inputs"],
        "targets": row["targets"],
        "segment_ids": row["inputs_segment_ids"],
        "positions": row["positions"] % seq_len,
    }


class _ConcatRows(grain.IterDataset):
    def __init__(self, chunks: grain.IterDataset, seq_len: int):
        super().__init__(chunks)
        self.seq_len = seq_len

    def __iter__(self) -> _ConcatRowIterator:
        return _ConcatRowIterator(self._parent.__iter__(), self.seq_len)


class _ConcatRowIterator(grain.DatasetIterator):
    """Fills each row from the chunk stream. State: the chunk iterator's state before the chunk being placed
    (`parent`) and how many of its tokens earlier rows took (`placed`), so a resumed row starts at the same token."""

    def __init__(self, parent: grain.DatasetIterator, seq_len: int):
        super().__init__(parent)
        self._seq_len = seq_len
        self._chunk: dict[str, np.ndarray] | None = None
        self._placed = 0
        self._before: dict[str, Any] = {}

    def __next__(self) -> dict[str, np.ndarray]:
        parts, filled = [], 0
        while filled < self._seq_len:
            if self._chunk is None:
                self._before = self._parent.get_state()
                try:
                    self._chunk = next(self._parent)
                except StopIteration:
                    if filled:
                        break
                    raise
                self._placed = 0
            count = min(self._seq_len - filled, len(self._chunk["inputs"]) - self._placed)
            parts.append({key: value[self._placed : self._placed + count] for key, value in self._chunk.items()})
            self._placed += count
            filled += count
            if self._placed == len(self._chunk["inputs"]):
                self._chunk = None
        return _concat_row(parts, self._seq_len)

    def get_state(self) -> dict[str, Any]:
        if self._chunk is None:
            return {"parent": self._parent.get_state(), "placed": 0}
        return {"parent": self._before, "placed": self._placed}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._chunk, self._placed = None, 0
        if state["placed"]:
            self._before, self._chunk, self._placed = state["parent"], next(self._parent), state["placed"]


def _concat_row(parts: list[dict[str, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """One row of the chunk parts that fill it (padded when they do not)."""
    row = {key: np.zeros(seq_len, np.int32) for key in ("tokens", "targets", "segment_ids", "positions")}
    filled = 0
    for part in parts:
        end = filled + len(part["inputs"])
        row["tokens"][filled:end], row["targets"][filled:end] = part["inputs"], part["targets"]
        row["positions"][filled:end] = part["positions"]
        filled = end
    starts = row["positions"][:filled] == 0
    starts[0] = True
    row["segment_ids"][:filled] = np.cumsum(starts)
    continued = row["segment_ids"] == 1  # the row's first segment, perhaps a document's continuation
    row["positions"][continued] -= row["positions"][0]
    return row
