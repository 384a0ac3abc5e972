"""Grain input pipeline: documents -> token ids -> packed rows of seq_len tokens -> numpy batches.

    held-out split -> doc indices -> upsample long documents, shuffle + repeat (train)
    -> mix the components of data.mixture by weight -> tokenize -> (inputs, targets)
    -> pack (concat: split documents across rows | first_fit: cut to seq_len, pad rows)
    -> model fields -> batch -> thread prefetch

Each batch is a dict of numpy arrays, all [batch_size, seq_len]:
    tokens      int32    input ids (tokenizer.pad_id on padding)
    targets     int32    next-token ids, packed in lockstep with tokens so a target never
                         crosses a document boundary (tokenizer.pad_id on padding)
    segment_ids int32    1, 2, ... per document piece within the row; 0 on padding
    positions   int32    0, 1, 2, ... restarting in each segment; 0 on padding
    loss_mask   float32  1 where `targets` is a real next token of the same document, else 0

`iter(build_dataset(...))` is a grain iterator with `get_state()` / `set_state(state)`; its state
is plain JSON (dicts, lists, ints, strings), so `json.dumps(it.get_state())` saved at step k and
`set_state(json.loads(text))` on a fresh iterator replays the following batches bit for bit.
Everything runs in this process (a few reader threads, one prefetch thread); no workers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grain
import numpy as np

from train.errors import DataError
from train.sources import Concat, Mixture, Source, open_source
from train.tokenizer import Tokenizer

if TYPE_CHECKING:  # the run config imports this module's registries
    from train.config.schema import DataConfig

log = logging.getLogger(__name__)
PACKINGS = ("concat", "first_fit")
# the arrays of a batch, each [rows, seq_len], and their dtypes
BATCH_FIELDS = {
    "tokens": np.int32,
    "targets": np.int32,
    "segment_ids": np.int32,
    "positions": np.int32,
    "loss_mask": np.float32,
}
SPLITS = ("train", "eval")
MIN_PACKING_BINS = 16  # first_fit packs into max(batch_size, this) rows at a time
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=32)  # document read + tokenize
PREFETCH_BATCHES = 2
_TUPLE = "__tuple__"  # JSON stand-in for the tuples inside grain's packer state


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


class _HeadAndTail:
    """A one-document source as two documents: 0 is its text less the last `fraction` of its characters,
    1 is that tail; each gets at least one character where the text has two."""

    def __init__(self, source: Source, fraction: float):
        self.source = source
        self.fraction = fraction

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> str:
        text = self.source[0]
        cut = len(text) - min(max(1, round(len(text) * self.fraction)), len(text) - 1)
        return (text[:cut], text[cut:])[index]

    def sizes(self) -> np.ndarray:
        size = int(self.source.sizes()[0])
        tail = round(size * self.fraction)
        return np.asarray([size - tail, tail], np.int64)


def upsample(indices: np.ndarray, long: np.ndarray, weight: float, seed: int) -> np.ndarray:
    """`indices` with each one flagged `long` repeated `weight` times (a fraction by a seeded coin, so that the
    expected count is `weight`), the others once; in their order."""
    whole, fraction = divmod(weight, 1.0)
    coin = np.random.default_rng(np.random.SeedSequence([seed, 1])).random(len(indices)) < fraction
    return np.repeat(indices, np.where(long, int(whole) + coin, 1))


def describe_sizes(sizes: np.ndarray, long: np.ndarray, weight: float) -> str:
    """One log line: documents by size (powers of 4 KiB) and the long documents' share of bytes before and after
    upsampling."""
    edges = [0, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, np.inf]
    counts, _ = np.histogram(sizes, bins=edges)
    labels = ["<4K", "4K-16K", "16K-64K", "64K-256K", "256K-1M", ">=1M"]
    total = max(int(sizes.sum()), 1)
    share = sizes[long].sum() / total
    after = weight * share / (weight * share + (1 - share)) if share < 1 else 1.0
    histogram = ", ".join(f"{label}: {count}" for label, count in zip(labels, counts, strict=True) if count)
    return (
        f"train documents by size in bytes ({histogram}); long documents: {int(long.sum())} of {len(sizes)}, "
        f"{share:.1%} of the bytes, {after:.1%} after upsampling x{weight:g}"
    )


def held_out(source: Source, eval_fraction: float, seed: int) -> tuple[Source, np.ndarray, np.ndarray]:
    """(documents, train indices, eval indices) into those documents, int64 [n_train] and [n_eval].

    Whole documents are held out (split_indices), except from a source of one document (a single text
    file), which no document split can serve: with eval_fraction > 0 its last eval_fraction of characters
    are held out, as nanoGPT splits a text file (the eval split reads that tail, the train split the rest).
    """
    if len(source) == 1 and eval_fraction > 0:
        return _HeadAndTail(source, eval_fraction), np.array([0]), np.array([1])
    return source, *split_indices(len(source), eval_fraction, seed)


def splits(source: Source, cfg: DataConfig) -> tuple[Source, list[np.ndarray], list[np.ndarray]]:
    """(documents, train indices, eval indices): one int64 array per component into `documents` (one for a plain
    source). Each component of a Mixture is held out on its own (held_out, seed cfg.seed + its index), so the eval
    split keeps the mix; `documents` is then their Concat."""
    parts = source.parts if isinstance(source, Mixture) else [source]
    documents, train, held, offset = [], [], [], 0
    for i, part in enumerate(parts):
        docs, train_idx, eval_idx = held_out(part, cfg.eval_fraction, cfg.seed + i)
        documents.append(docs)
        train.append(train_idx + offset)
        held.append(eval_idx + offset)
        offset += len(docs)
    return (Concat(documents) if isinstance(source, Mixture) else documents[0]), train, held


def _upsampled(documents: Source, indices: np.ndarray, cfg: DataConfig, name: str) -> np.ndarray:
    """Train `indices` with their long documents upsampled (data.long_document_*), the size histogram logged."""
    if not (cfg.long_document_bytes and cfg.long_document_weight != 1.0 and len(indices)):
        return indices
    sizes = documents.sizes()[indices]
    long = sizes >= cfg.long_document_bytes
    log.info("%s%s", name, describe_sizes(sizes, long, cfg.long_document_weight))
    return upsample(indices, long, cfg.long_document_weight, cfg.seed)


def document_weights(documents: Source, indices: Sequence[np.ndarray], byte_shares: np.ndarray) -> np.ndarray:
    """Per-component probabilities of drawing a document so that component i gets byte_shares[i] of the bytes in
    expectation: its share over its mean document size (the `indices`' sizes), normalized. [components] float64."""
    means = np.asarray([max(float(documents.sizes()[idx].mean()), 1.0) if len(idx) else 1.0 for idx in indices])
    weights = byte_shares / means
    return weights / weights.sum()


def describe_mixture(names: Sequence[str], counts: Sequence[int], shares: np.ndarray, weights: np.ndarray) -> str:
    """One log line: each component's share of the bytes and of the documents drawn, and its document count."""
    parts = [
        f"{name}: {share:.1%} of the bytes, {weight:.1%} of the documents ({count} documents)"
        for name, count, share, weight in zip(names, counts, shares, weights, strict=True)
    ]
    return "train mixture: " + "; ".join(parts)


class _Tokenize:
    """Document index -> {"inputs": ids[:-1], "targets": ids[1:]}, int32 [len - 1], with bos/eos added."""

    def __init__(self, source: Source, tokenizer: Tokenizer, add_bos: bool, add_eos: bool):
        self.source = source
        self.tokenizer = tokenizer
        self.prefix = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
        self.suffix = [tokenizer.eos_id] if add_eos and tokenizer.eos_id is not None else []

    def __call__(self, index) -> dict[str, np.ndarray]:
        ids = np.asarray(self.prefix + self.tokenizer.encode(self.source[int(index)]) + self.suffix, np.int32)
        return {"inputs": ids[:-1], "targets": ids[1:]}


def _has_input(example: dict[str, np.ndarray]) -> bool:
    return len(example["inputs"]) > 0


class _Pieces(grain.experimental.FlatMapTransform):
    """Cuts an example into consecutive pieces of at most seq_len tokens (inputs and targets alike)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def flat_map(self, example: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return [
            {key: value[start : start + self.seq_len] for key, value in example.items()}
            for start in range(0, len(example["inputs"]), self.seq_len)
        ]


def pack(examples: grain.IterDataset, *, seq_len: int, packing: str, num_bins: int) -> grain.IterDataset:
    """Packs {"inputs", "targets"} examples (int32 [n]) into rows of int32 [seq_len].

    Rows carry grain's packer fields: inputs, targets and, for each, *_segment_ids and *_positions.
    concat: documents are concatenated and split across rows (no padding until the stream ends);
    first_fit: documents are cut to seq_len pieces and first-fit into `num_bins` rows at a time,
    which are emitted in order and padded.
    """
    lengths = {"inputs": seq_len, "targets": seq_len}
    if packing == "concat":
        return grain.experimental.ConcatThenSplitIterDataset(examples, length_struct=lengths)
    if packing == "first_fit":
        pieces = grain.experimental.FlatMapIterDataset(examples, _Pieces(seq_len))
        return grain.experimental.FirstFitPackIterDataset(
            pieces, length_struct=lengths, num_packing_bins=num_bins, shuffle_bins=False
        )
    raise ValueError(f"data.packing={packing!r} is not allowed; choose one of {', '.join(PACKINGS)}")


def _model_row(row: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """Packer row -> the batch fields of the module docstring, each [seq_len]."""
    segment_ids = row["inputs_segment_ids"].astype(np.int32)
    real = segment_ids > 0
    fields = {
        "tokens": np.where(real, row["inputs"], pad_id),
        "targets": np.where(real, row["targets"], pad_id),
        "segment_ids": segment_ids,
        "positions": row["inputs_positions"],
        "loss_mask": real,
    }
    return {key: fields[key].astype(dtype) for key, dtype in BATCH_FIELDS.items()}


def _to_json(state: Any) -> Any:
    """Grain state -> JSON-native: tuples become {"__tuple__": [...]}, numpy scalars Python ones."""
    if isinstance(state, dict):
        return {key: _to_json(value) for key, value in state.items()}
    if isinstance(state, tuple):
        return {_TUPLE: [_to_json(value) for value in state]}
    if isinstance(state, list):
        return [_to_json(value) for value in state]
    if isinstance(state, np.generic):
        return state.item()
    return state


def _from_json(state: Any) -> Any:
    """Inverse of _to_json."""
    if isinstance(state, dict):
        if set(state) == {_TUPLE}:
            return tuple(_from_json(value) for value in state[_TUPLE])
        return {key: _from_json(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_from_json(value) for value in state]
    return state


class _JsonStateIterator(grain.DatasetIterator):
    """Passes elements through; get_state/set_state speak JSON-native state.

    Needed because grain's concat packer keeps tuples in its state and, after a JSON round
    trip, would mistake the lists for slices of a pending document.
    """

    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return _to_json(self._parent.get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(_from_json(state))


class _JsonStateIterDataset(grain.IterDataset):
    def __iter__(self) -> _JsonStateIterator:
        return _JsonStateIterator(self._parent.__iter__())


def _documents(indices: np.ndarray, cfg: DataConfig, split: str, num_epochs: int | None, component: int):
    """MapDataset of document indices: the train split shuffled (each epoch anew, seeded by cfg.seed and the
    mixture component), then repeated num_epochs times (None: forever)."""
    docs = grain.MapDataset.source(indices)
    if split == "train" and cfg.shuffle:
        # Grain reseeds epoch e with seed + e; a hashed seed keeps runs with seeds s and s+1 apart.
        entropy = cfg.seed if component == 0 else [cfg.seed, component]
        docs = docs.shuffle(seed=int(np.random.SeedSequence(entropy).generate_state(1)[0]))
    return docs.repeat(num_epochs)


def build_dataset(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    batch_size: int,
    split: str = "train",
    num_epochs: int | None = None,
    source: Source | None = None,
) -> grain.IterDataset:
    """Batches of `split`, as described in the module docstring.

    batch_size is in rows of cfg.seq_len tokens: the whole batch (every process reads it all and keeps its
    rows). Documents become [bos] + ids + [eos] (bos/eos added when cfg.add_bos/add_eos and the tokenizer has
    one); those left with fewer than two ids are skipped. Train documents are shuffled by cfg.seed when
    cfg.shuffle, each epoch in a different deterministic order; eval keeps document order. num_epochs=None
    repeats forever; with a finite count the last incomplete batch is dropped, so a small split can give no
    batch at all. `source` (default: open_source(cfg)) lets the train and eval splits share one opened, indexed
    source. The eval split is held_out's: whole documents, or the tail of a single document.

    With data.mixture, each component is split, upsampled and shuffled on its own, then documents are drawn from
    the components (grain's MapDataset.mix, deterministic) so that each one's expected share of the bytes is its
    weight, in the train and the eval split alike; with a finite num_epochs the stream ends when the first
    component runs out.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; choose one of {', '.join(SPLITS)}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be >= 1")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs={num_epochs!r} must be >= 1 or None (repeat forever)")
    if cfg.packing not in PACKINGS:
        raise ValueError(f"data.packing={cfg.packing!r} is not allowed; choose one of {', '.join(PACKINGS)}")

    source = open_source(cfg) if source is None else source
    documents, train_idx, eval_idx = splits(source, cfg)
    names = source.names if isinstance(source, Mixture) else [f"data.source={cfg.source!r}"]
    indices = train_idx if split == "train" else eval_idx
    if split == "train":
        indices = [
            _upsampled(documents, idx, cfg, f"{name}: " if len(names) > 1 else "")
            for name, idx in zip(names, indices, strict=True)
        ]
    for name, idx, train, held in zip(names, indices, train_idx, eval_idx, strict=True):
        if len(idx) == 0:
            raise DataError(
                f"split={split!r} has no documents: {len(train) + len(held)} documents in {name} with "
                f"data.eval_fraction={cfg.eval_fraction}; eval needs data.eval_fraction > 0"
            )
    streams = [_documents(idx, cfg, split, num_epochs, i) for i, idx in enumerate(indices)]
    docs = streams[0]
    if isinstance(source, Mixture):
        weights = document_weights(documents, indices, source.weights)
        if split == "train":
            log.info("%s", describe_mixture(names, [len(idx) for idx in indices], source.weights, weights))
        docs = grain.MapDataset.mix(streams, weights.tolist())
    examples = docs.map(_Tokenize(documents, tokenizer, cfg.add_bos, cfg.add_eos)).filter(_has_input)

    rows = pack(
        examples.to_iter_dataset(READ_OPTIONS),
        seq_len=cfg.seq_len,
        packing=cfg.packing,
        num_bins=max(batch_size, MIN_PACKING_BINS),
    )
    batches = rows.map(functools.partial(_model_row, pad_id=tokenizer.pad_id)).batch(batch_size, drop_remainder=True)
    batches = grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=PREFETCH_BATCHES)
    return _JsonStateIterDataset(batches)
