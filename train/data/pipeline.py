"""Grain input pipeline: documents -> token ids -> packed rows of seq_len tokens -> numpy batches.

    held-out split (train/data/held_out.py) -> span indices -> upsample long documents, shuffle + repeat (train)
    -> mix the components of data.mixture by weight -> read and tokenize a piece at a time, chunks of at most
    seq_len tokens (train/data/token_stream.py) -> pack (concat: split documents across rows | first_fit: seq_len
    pieces, pad rows; train/data/packing.py) -> model fields -> batch -> thread prefetch

Each batch is a dict of numpy arrays, all [batch_size, seq_len]:
    tokens      int32    input ids (tokenizer.pad_id on padding)
    targets     int32    next-token ids, packed in lockstep with tokens so a target never
                         crosses a document boundary (tokenizer.pad_id on padding)
    segment_ids int32    1, 2, ... per document (or part of one) within the row; 0 on padding
    positions   int32    0, 1, 2, ... from a document's start, counting on across rows; 0 on padding
    loss_mask   float32  1 where `targets` is a real next token of the same document, else 0

A document is one segment however many rows it spans: bos and eos only at its real start and end, positions
restarting only there (and at the start of a held-out tail). The pipeline holds a few pieces of about a MiB of
text and the rows being packed, never a whole document, whatever its size.

`iter(build_dataset(...))` is a grain iterator with `get_state()` / `set_state(state)`; its state
is plain JSON (dicts, ints, None), so `json.dumps(it.get_state())` saved at step k and
`set_state(json.loads(text))` on a fresh iterator replays the following batches bit for bit.
Everything runs in this process (a prefetch thread, and two threads that work out the document order ahead); no
workers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grain
import numpy as np

from train.data.batch import BATCH_FIELDS
from train.data.held_out import Spans, splits
from train.data.packing import PACKINGS, pack
from train.data.sources import Mixture, Source, open_source
from train.data.token_stream import Chunks
from train.data.tokenizer import Tokenizer
from train.errors import DataError

if TYPE_CHECKING:  # the run config imports this module's registries
    from train.config.schema import DataConfig

log = logging.getLogger(__name__)
SPLITS = ("train", "eval")
MIN_PACKING_BINS = 16  # first_fit packs into max(batch_size, this) rows at a time
PREFETCH_BATCHES = 2


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


def _upsampled(documents: Spans, indices: np.ndarray, cfg: DataConfig, name: str) -> np.ndarray:
    """Train `indices` with their long documents upsampled (data.long_document_*), the size histogram logged."""
    if not (cfg.long_document_bytes and cfg.long_document_weight != 1.0 and len(indices)):
        return indices
    sizes = documents.sizes()[indices]
    long = sizes >= cfg.long_document_bytes
    log.info("%s%s", name, describe_sizes(sizes, long, cfg.long_document_weight))
    return upsample(indices, long, cfg.long_document_weight, cfg.seed)


def document_weights(documents: Spans, indices: Sequence[np.ndarray], byte_shares: np.ndarray) -> np.ndarray:
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


def _model_row(row: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """Packed row (train/data/packing.py) -> the batch fields of the module docstring, each [seq_len]."""
    real = row["segment_ids"] > 0
    fields = {
        "tokens": np.where(real, row["tokens"], pad_id),
        "targets": np.where(real, row["targets"], pad_id),
        "segment_ids": row["segment_ids"],
        "positions": row["positions"],
        "loss_mask": real,
    }
    return {key: fields[key].astype(dtype) for key, dtype in BATCH_FIELDS.items()}


def _documents(indices: np.ndarray, cfg: DataConfig, split: str, num_epochs: int | None, component: int):
    """MapDataset of span indices: the train split shuffled (each epoch anew, seeded by cfg.seed and the
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
    one, at a document's real start and end: not where its held-out tail is cut off); those left with fewer than
    two ids are skipped. Train documents are shuffled by cfg.seed when cfg.shuffle, each epoch in a different
    deterministic order; eval keeps document order. num_epochs=None repeats forever; with a finite count the last
    incomplete batch is dropped, so a small split can give no batch at all. `source` (default: open_source(cfg))
    lets the train and eval splits share one opened, indexed source. The eval split is train/data/held_out.py's: whole
    documents, and the tails of documents too long to hold out whole.

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
    chunks = Chunks(docs, documents, tokenizer, bos=cfg.add_bos, eos=cfg.add_eos, seq_len=cfg.seq_len)
    rows = pack(chunks, seq_len=cfg.seq_len, packing=cfg.packing, num_bins=max(batch_size, MIN_PACKING_BINS))
    batches = rows.map(functools.partial(_model_row, pad_id=tokenizer.pad_id)).batch(batch_size, drop_remainder=True)
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=PREFETCH_BATCHES)
