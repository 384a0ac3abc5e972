"""The held-out split, by bytes: data.eval_fraction of each source's stored bytes goes to the eval split.

A document of at most eval_fraction of the source's bytes is held out whole or not at all: eval_fraction of those
documents, chosen by data.seed (split_indices). A longer one, which no whole-document choice could hold out without
taking too much (a single text file, a folder of a few books), gives its last eval_fraction of stored bytes to the
eval split and keeps the rest for training, as nanoGPT splits a text file. Either way the eval split holds about
eval_fraction of the bytes, whatever the documents' sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from train.data.cuts import PIECE_BYTES
from train.data.sources import Mixture, Source

if TYPE_CHECKING:  # the run config imports the data modules' registries
    from train.config.schema import DataConfig


@dataclass(frozen=True)
class Piece:
    """A piece of a span's text: bos goes before it when it starts its document, eos after it when it ends it."""

    text: str
    next: int | None  # the stored byte where the span's next piece starts; None: this is its last
    starts_document: bool
    ends_document: bool


class Spans:
    """What the splits read: span i < len(source) is document i, less its tail when that is held out; span
    len(source) + j is the tail of document tails[j] (about `tail_fraction` of it), from stored byte cuts[j] on.
    Indexes like a source."""

    def __init__(self, source: Source, tails: np.ndarray, cuts: np.ndarray, tail_fraction: float):
        self.source = source
        self.tails = np.asarray(tails, np.int64)
        self.cuts = np.asarray(cuts, np.int64)
        self.tail_fraction = tail_fraction
        self._heads = dict(zip(self.tails.tolist(), self.cuts.tolist(), strict=True))  # document -> where it ends

    def __len__(self) -> int:
        return len(self.source) + len(self.tails)

    def bounds(self, index: int) -> tuple[int, int, int | None]:
        """(document, first stored byte, end: None for the document's end) of span `index`."""
        if index < len(self.source):
            return index, 0, self._heads.get(index)
        return int(self.tails[index - len(self.source)]), int(self.cuts[index - len(self.source)]), None

    def piece(self, index: int, start: int) -> Piece:
        """The piece of span `index` that starts at stored byte `start` (bounds' first byte, or a Piece's next)."""
        document, _, stop = self.bounds(index)
        text, after = self.source.read(document, start, stop, PIECE_BYTES)
        return Piece(text, after, starts_document=start == 0, ends_document=after is None and stop is None)

    def __getitem__(self, index: int) -> str:
        """The whole text of span `index`."""
        document, start, stop = self.bounds(index)
        if start == 0 and stop is None:
            return self.source[document]
        texts = []
        while start is not None:
            text, start = self.source.read(document, start, stop, PIECE_BYTES)
            texts.append(text)
        return "".join(texts)

    def sizes(self) -> np.ndarray:
        """[len] int64: each span's size in bytes (a tail's taken as tail_fraction of its document's)."""
        sizes = self.source.sizes().copy()
        tail_sizes = np.round(sizes[self.tails] * self.tail_fraction).astype(np.int64)
        sizes[self.tails] -= tail_sizes
        return np.concatenate([sizes, tail_sizes])


def split_indices(n_docs: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Held-out split of range(n_docs): (train [n_train], eval [n_eval]) int64, each sorted.

    eval gets max(1, round(n_docs * eval_fraction)) documents when eval_fraction > 0 and n_docs > 1,
    else none; train always keeps at least one. The same arguments give the same split.
    """
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction={eval_fraction!r} must be in [0, 1)")
    n_eval = min(max(1, round(n_docs * eval_fraction)), n_docs - 1) if eval_fraction > 0 and n_docs > 1 else 0
    order = np.random.default_rng(seed).permutation(n_docs)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def split_by_bytes(sizes: np.ndarray, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(train documents, eval documents, documents whose tail is held out), int64 each, sorted: documents of at
    most eval_fraction of the bytes split by split_indices, the longer ones split in two."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction={eval_fraction!r} must be in [0, 1)")
    if eval_fraction == 0:
        return np.arange(len(sizes)), np.zeros(0, np.int64), np.zeros(0, np.int64)
    long = sizes > eval_fraction * sizes.sum()
    short = np.flatnonzero(~long)
    train, held = split_indices(len(short), eval_fraction, seed)
    return short[train], short[held], np.flatnonzero(long)


def splits(source: Source, cfg: DataConfig) -> tuple[Spans, list[np.ndarray], list[np.ndarray]]:
    """(spans, train indices, eval indices): one int64 array of span indices per component of a Mixture (one for
    a plain source), each held out on its own (split_by_bytes, seed cfg.seed + its index) so the eval split keeps
    the mix. A document held out whole keeps its index as a span."""
    parts = source.parts if isinstance(source, Mixture) else [source]
    train, held, tails, offset = [], [], [], 0
    for i, part in enumerate(parts):
        whole_train, whole_eval, long = split_by_bytes(part.sizes(), cfg.eval_fraction, cfg.seed + i)
        tail_spans = len(source) + len(tails) + np.arange(len(long))
        tails += (long + offset).tolist()
        train.append(np.sort(np.concatenate([whole_train, long])) + offset)
        held.append(np.concatenate([whole_eval + offset, tail_spans]))
        offset += len(part)
    cuts = [source.tail_start(document, cfg.eval_fraction) for document in tails]
    return Spans(source, np.asarray(tails, np.int64), np.asarray(cuts, np.int64), cfg.eval_fraction), train, held
