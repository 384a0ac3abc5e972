"""Spans -> token chunks, read and tokenized a piece at a time, so memory does not grow with a document.

A span's ids are [bos] + its text's tokens + [eos], bos where it starts its document and eos where it ends it (the head
of a document whose tail is held out has no eos, the tail no bos). Position p of a span is ids[p]: its place in the
span, counting on across pieces (train/data/packing.py counts a row's from its segments' starts). A chunk is `inputs`
ids[p:p+n], `targets` ids[p+1:p+n+1] and `positions` p..p+n-1 (int32 [n] each) of one span; chunks never cross a
multiple of seq_len of positions, so a span longer than seq_len is cut into seq_len pieces as first_fit packing wants
them. At most the pieces that hold the next chunk are held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from train.data.held_out import Spans
from train.data.tokenizer import Tokenizer

STATE_KEYS = ("order", "piece", "skip", "position")
# span indices are worked out ahead in threads: a shuffled index takes grain about a millisecond
ORDER_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=64)


@dataclass(frozen=True)
class _Loaded:
    """A piece of the current span as token ids."""

    start: int  # its first stored byte
    ids: np.ndarray  # int32 [n]
    next: int | None  # where the span's next piece starts; None: this is its last


class Chunks(grain.IterDataset):
    """The chunks of the spans `order` gives (a MapDataset of span indices into `spans`, read in order)."""

    def __init__(
        self, order: grain.MapDataset, spans: Spans, tokenizer: Tokenizer, *, bos: bool, eos: bool, seq_len: int
    ):
        order = order.to_iter_dataset(ORDER_READ_OPTIONS)
        super().__init__(order)
        self.order = order
        self.spans = spans
        self.tokenizer = tokenizer
        self.bos = [tokenizer.bos_id] if bos and tokenizer.bos_id is not None else []
        self.eos = [tokenizer.eos_id] if eos and tokenizer.eos_id is not None else []
        self.seq_len = seq_len

    def __iter__(self) -> ChunkIterator:
        return ChunkIterator(self)


class ChunkIterator(grain.DatasetIterator):
    """Iterates Chunks; its state is plain JSON: `order` (the span order's state before the current span), `piece`
    (the first stored byte of the piece that holds the next token; None between spans), `skip` (the ids of that
    piece already read) and `position` (of the next token in its span)."""

    def __init__(self, chunks: Chunks):
        super().__init__(chunks.order.__iter__())
        self._chunks = chunks
        self._pieces: list[_Loaded] = []
        self._before = self._parent.get_state()

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            if not self._pieces:
                self._before = self._parent.get_state()
                self._span = int(next(self._parent))
                self._pieces, self._skip, self._position = [self._load(self._chunks.spans.bounds(self._span)[1])], 0, 0
            wanted = self._chunks.seq_len - self._position % self._chunks.seq_len + 1  # inputs, and one more target
            while self._available() < wanted and self._pieces[-1].next is not None:
                self._pieces.append(self._load(self._pieces[-1].next))
            count = min(wanted, self._available()) - 1
            if count < 1:
                self._pieces = []
                continue
            ids = self._take(count + 1)
            positions = np.arange(self._position, self._position + count, dtype=np.int32)
            self._position += count
            return {"inputs": ids[:-1], "targets": ids[1:], "positions": positions}

    def get_state(self) -> dict[str, Any]:
        if not self._pieces:
            return {"order": self._parent.get_state(), "piece": None, "skip": 0, "position": 0}
        return {"order": self._before, "piece": self._pieces[0].start, "skip": self._skip, "position": self._position}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or sorted(state) != sorted(STATE_KEYS):
            raise ValueError(f"data position {state!r} is not this pipeline's: it holds {', '.join(STATE_KEYS)}")
        self._parent.set_state(state["order"])
        self._before, self._skip, self._position, self._pieces = state["order"], state["skip"], state["position"], []
        if state["piece"] is not None:
            self._span = int(next(self._parent))
            self._pieces = [self._load(state["piece"])]

    def _load(self, start: int) -> _Loaded:
        piece = self._chunks.spans.piece(self._span, start)
        bos = self._chunks.bos if piece.starts_document else []
        eos = self._chunks.eos if piece.ends_document else []
        return _Loaded(start, np.asarray(bos + self._chunks.tokenizer.encode(piece.text) + eos, np.int32), piece.next)

    def _available(self) -> int:
        return sum(len(piece.ids) for piece in self._pieces) - self._skip

    def _take(self, count: int) -> np.ndarray:
        """The next `count` ids (count <= _available()); the first count - 1 of them are then read."""
        parts, skip = [], self._skip
        for piece in self._pieces:
            parts.append(piece.ids[skip : skip + count - sum(len(part) for part in parts)])
            skip = max(0, skip - len(piece.ids))
        self._skip += count - 1
        while len(self._pieces) > 1 and self._skip >= len(self._pieces[0].ids):
            self._skip -= len(self._pieces.pop(0).ids)
        return np.concatenate(parts)
