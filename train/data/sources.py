"""Random-access document sources: `len(source)` documents, `source[i]` -> str, read lazily.

Kinds: the stored file kinds of train/data/files.py (plain text: a file is one document, a folder gives one document
per matching file; JSON lines: one object per line; Parquet: one row per document), "stdlib" (the Python standard
library's own `*.py` files, a corpus present offline everywhere) and "retrieval" (synthetic needle-retrieval
documents of data.seq_len - 1 bytes, train/data/retrieval.py). A folder of JSONL or Parquet files (data.format set
explicitly) is read as their concatenation, a data.mixture as its components' (`Mixture`). Sources hold paths and
small indexes, never the corpus, and pickle without open files.

Besides the whole text, every source reads a document a piece at a time (`read`, cut as train/data/cuts.py says) from
any place in its stored text, so a document of any size is read in bounded memory; `tail_start` says where its last
fraction begins.

Bad data stops the run with a DataError naming the file (and line) before training starts, as far as indexing can
tell: every JSON line is parsed when its file is indexed, every text file's head is read when its folder is listed
(files that are not UTF-8 text are skipped, with a logged count; stray invalid bytes read as U+FFFD, logged once a
file), and an unreadable file or folder is an error, never skipped. A file that becomes unreadable later fails with
a DataError naming it when it is read.
"""

from __future__ import annotations

import bisect
import dataclasses
import pathlib
import sysconfig
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from train.data import cuts
from train.data.files import READERS, SNIFF_BYTES, TextFiles, list_files, text_only
from train.data.retrieval import RetrievalSource
from train.errors import DataError

if TYPE_CHECKING:  # the run config imports this module's registries
    from train.config.schema import DataConfig, MixtureComponent

SOURCE_HELP = '"stdlib", "retrieval", a text file, a folder, a .jsonl/.json file or a .parquet file'


class Source(Protocol):
    """What every source provides; sources also pickle (they hold paths and indexes only)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> str: ...

    def sizes(self) -> np.ndarray: ...  # [len] int64: each document's size in bytes, known without reading it

    # the text of document `index` from stored byte `start`, about `size` bytes cut at a line, word or character (the
    # rest when no more), at most to stored byte `stop` (None: the document's end), and where the next piece starts
    # (None: at `stop`)
    def read(self, index: int, start: int, stop: int | None, size: int) -> tuple[str, int | None]: ...

    def tail_start(self, index: int, fraction: float) -> int: ...  # the stored byte where its last `fraction` begins


def stdlib_source() -> TextFiles:
    """The standard library's UTF-8 `*.py` files (installed packages excluded), sorted by path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = list_files(root, "*.py", skip_dirs=frozenset({"site-packages", "dist-packages"}))
    return TextFiles(text_only(files)[0])


class Concat:
    """Several sources read one after the other."""

    def __init__(self, parts: Sequence[Source]):
        self.parts = list(parts)
        self._ends = np.cumsum([len(part) for part in self.parts]).tolist()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> str:
        part, local = self._locate(index)
        return part[local]

    def sizes(self) -> np.ndarray:
        return np.concatenate([part.sizes() for part in self.parts]) if self.parts else np.zeros(0, np.int64)

    def read(self, index: int, start: int, stop: int | None, size: int) -> tuple[str, int | None]:
        part, local = self._locate(index)
        return part.read(local, start, stop, size)

    def tail_start(self, index: int, fraction: float) -> int:
        part, local = self._locate(index)
        return part.tail_start(local, fraction)

    def _locate(self, index: int) -> tuple[Source, int]:
        """(the part that holds document `index`, its index there)."""
        part = bisect.bisect_right(self._ends, index)
        return self.parts[part], index - (self._ends[part - 1] if part else 0)


class Mixture(Concat):
    """The components of data.mixture read one after the other, with their names and weights (shares of the train
    bytes, normalized); train/data/pipeline.py draws from them by weight."""

    def __init__(self, parts: Sequence[Source], names: Sequence[str], weights: Sequence[float]):
        super().__init__(parts)
        self.names = list(names)
        self.weights = np.asarray(weights, np.float64) / np.sum(weights)


class Head:
    """The first `count` documents of `source`."""

    def __init__(self, source: Source, count: int):
        self.source = source
        self.count = min(count, len(source))

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < self.count:
            raise IndexError(f"document {index} out of range for {self.count} documents")
        return self.source[index]

    def sizes(self) -> np.ndarray:
        return self.source.sizes()[: self.count]

    def read(self, index: int, start: int, stop: int | None, size: int) -> tuple[str, int | None]:
        return self.source.read(index, start, stop, size)

    def tail_start(self, index: int, fraction: float) -> int:
        return self.source.tail_start(index, fraction)


class InMemory:
    """Documents that `source` builds as strings when asked (source[i] -> str), read in pieces of that string; its
    stored text is the string's UTF-8 bytes."""

    def __init__(self, source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> str:
        return self.source[index]

    def sizes(self) -> np.ndarray:
        return self.source.sizes()

    def read(self, index: int, start: int, stop: int | None, size: int) -> tuple[str, int | None]:
        data = self.source[index].encode()
        stop = len(data) if stop is None else stop
        return cuts.read_piece(_bytes_reader(data), start, stop, size, escaped=False, path="a synthetic document")

    def tail_start(self, index: int, fraction: float) -> int:
        data = self.source[index].encode()
        return cuts.tail_start(_bytes_reader(data), len(data), fraction, escaped=False)


def _bytes_reader(data: bytes):
    """fetch(offset, count) -> bytes of `data` (cuts.read_piece's reader of stored bytes)."""
    return lambda offset, count: data[offset : offset + count]


FORMATS = ("auto", "text", *READERS)  # data.format


def _format_of(path: pathlib.Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.is_file() and path.suffix == ".parquet":
        return "parquet"
    return "text"


def _component(cfg: DataConfig, component: MixtureComponent) -> DataConfig:
    """The `data` section reading one mixture component alone."""
    given = {key: getattr(component, key) for key in ("format", "text_field", "file_pattern", "max_documents")}
    given = {key: value for key, value in given.items() if value is not None}
    return dataclasses.replace(cfg, source=component.source, mixture=(), **given)


def open_source(cfg: DataConfig) -> Source:
    """The documents named by cfg.source / cfg.format / cfg.file_pattern, cut to cfg.max_documents.

    Every file is indexed here (see the module docstring), so bad data fails now with a DataError. With
    cfg.mixture, a Mixture of its components, each opened with the `data` fields it leaves unset.
    """
    if cfg.mixture:
        parts = [open_source(_component(cfg, component)) for component in cfg.mixture]
        return Mixture(parts, [component.source for component in cfg.mixture], [c.weight for c in cfg.mixture])
    skipped = ""  # text: the note on files skipped as not UTF-8 text
    if cfg.source == "stdlib":
        source, where = stdlib_source(), "data.source='stdlib'"
    elif cfg.source == "retrieval":
        source, where = InMemory(RetrievalSource(cfg.seq_len)), "data.source='retrieval'"
    else:
        path = pathlib.Path(cfg.source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data.source={cfg.source!r} does not exist; data.source accepts {SOURCE_HELP}")
        fmt = _format_of(path, cfg.format)
        where = f"data.source={cfg.source!r}"
        files = [path]
        if path.is_dir():
            files = list_files(path, cfg.file_pattern)
            where += f" with data.file_pattern={cfg.file_pattern!r}"
        if fmt == "text":
            files, skipped = text_only(files)
            source = TextFiles(files)
        elif fmt in READERS:
            parts = [READERS[fmt](f, cfg.text_field) for f in files]
            source = parts[0] if len(parts) == 1 else Concat(parts)
        else:
            raise DataError(f"data.format={cfg.format!r} is not allowed; choose one of {', '.join(FORMATS)}")
    if cfg.max_documents:
        source = Head(source, cfg.max_documents)
    if not any(_has_text(source, i) for i in range(len(source))):
        empty = f"empty corpus: {where} has no documents" + (" with any text" if len(source) else "")
        raise DataError(empty + (f" ({skipped})" if skipped else ""))
    return source


def _has_text(source: Source, index: int) -> bool:
    """Whether document `index` has any text (its first piece read)."""
    text, rest = source.read(index, 0, None, SNIFF_BYTES)
    return bool(text) or rest is not None
