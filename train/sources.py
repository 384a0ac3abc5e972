"""Random-access document sources: `len(source)` documents, `source[i]` -> str, read lazily.

Kinds: plain text (a file is one document; a folder gives one document per matching file),
JSON lines (one object per line), Parquet (one row per document) and "stdlib" (the Python
standard library's own `*.py` files, a corpus present offline everywhere). A folder of JSONL or
Parquet files (data.format set explicitly) is read as their concatenation. Sources hold paths
and small indexes, never the corpus, and pickle without open files.
"""

from __future__ import annotations

import bisect
import json
import os
import pathlib
import sysconfig
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import pyarrow.parquet as pq

from train.errors import DataError

if TYPE_CHECKING:  # the run config imports this module's registries
    from train.config.schema import DataConfig

SOURCE_HELP = '"stdlib", a text file, a folder, a .jsonl/.json file or a .parquet file'


class Source(Protocol):
    """What every source provides; sources also pickle (they hold paths and indexes only)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> str: ...


def _list_files(root: pathlib.Path, pattern: str, skip_dirs: frozenset[str] = frozenset()) -> list[pathlib.Path]:
    """Files under `root` at any depth whose path matches `pattern` (from the right, like
    `PurePath.match`: "*.txt", "train/*.jsonl"), sorted; hidden entries and `skip_dirs` are skipped."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip_dirs]
        for name in files:
            path = pathlib.Path(folder, name)
            if not name.startswith(".") and path.relative_to(root).match(pattern) and path.is_file():
                found.append(path)
    return sorted(found)


class TextFiles:
    """Each file is one document, decoded as UTF-8 with invalid bytes replaced."""

    def __init__(self, paths: Sequence[pathlib.Path | str]):
        self.paths = [str(path) for path in paths]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> str:
        return pathlib.Path(self.paths[index]).read_bytes().decode("utf-8", errors="replace")


def stdlib_source() -> TextFiles:
    """The standard library's `*.py` files (installed packages excluded), sorted by path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return TextFiles(_list_files(root, "*.py", skip_dirs=frozenset({"site-packages", "dist-packages"})))


class JsonlFile:
    """One JSON object per line; the document is `obj[text_field]`. Empty lines are skipped.

    Line start offsets (int64 [num_docs]) are found once; each read seeks to its line.
    """

    def __init__(self, path: pathlib.Path | str, text_field: str, chunk_bytes: int = 1 << 24):
        self.path = str(path)
        self.text_field = text_field
        found = [np.zeros(0, np.int64)]
        offset = 0
        with open(self.path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                found.append(offset + np.flatnonzero(np.frombuffer(chunk, np.uint8) == ord("\n")))
                offset += len(chunk)
        ends = np.concatenate(found).astype(np.int64)  # offset of each line's "\n" (its exclusive end)
        if offset and (ends.size == 0 or ends[-1] != offset - 1):
            ends = np.append(ends, offset)  # last line without a trailing newline
        starts = np.concatenate([[0], ends + 1])[: len(ends)].astype(np.int64)
        keep = ends > starts
        self._starts = starts[keep]
        self._lengths = (ends - starts)[keep]
        self._line_numbers = np.flatnonzero(keep) + 1

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> str:
        with open(self.path, "rb") as f:
            f.seek(int(self._starts[index]))
            line = f.read(int(self._lengths[index]))
        where = f"{self.path} line {self._line_numbers[index]}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where} is not valid JSON: {error}") from None
        if not isinstance(obj, dict):
            raise DataError(
                f"{where} is a JSON {type(obj).__name__}; expected an object with field {self.text_field!r}"
            )
        if self.text_field not in obj:
            raise DataError(f"{where} has no field {self.text_field!r} (data.text_field); keys present: {sorted(obj)}")
        text = obj[self.text_field]
        if not isinstance(text, str):
            raise DataError(f"{where}: field {self.text_field!r} is a {type(text).__name__}; expected a string")
        return text


class ParquetFile:
    """Column `text_field` of a Parquet file, one document per row.

    Rows are located by (row group, row); the last `cache_groups` row groups read are kept.
    """

    def __init__(self, path: pathlib.Path | str, text_field: str, cache_groups: int = 2):
        self.path = str(path)
        self.text_field = text_field
        self.cache_groups = cache_groups
        metadata = pq.ParquetFile(self.path)
        columns = metadata.schema_arrow.names
        if text_field not in columns:
            raise DataError(f"{self.path} has no column {text_field!r} (data.text_field); available columns: {columns}")
        counts = [metadata.metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._group_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._open()

    def _open(self) -> None:
        self._file: pq.ParquetFile | None = None
        self._cache: OrderedDict[int, list] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_file", "_cache", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return int(self._group_starts[-1])

    def _row_group(self, group: int) -> list:
        with self._lock:
            if group in self._cache:
                self._cache.move_to_end(group)
                return self._cache[group]
            if self._file is None:
                self._file = pq.ParquetFile(self.path)
            rows = self._file.read_row_group(group, columns=[self.text_field]).column(0).to_pylist()
            self._cache[group] = rows
            while len(self._cache) > self.cache_groups:
                self._cache.popitem(last=False)
            return rows

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {self.path} with {len(self)} rows")
        group = int(np.searchsorted(self._group_starts, index, side="right")) - 1
        text = self._row_group(group)[index - int(self._group_starts[group])]
        if not isinstance(text, str):
            raise DataError(
                f"{self.path} row {index}: column {self.text_field!r} holds {type(text).__name__}; expected a string"
            )
        return text


class Concat:
    """Several sources read one after the other."""

    def __init__(self, parts: Sequence[Source]):
        self.parts = list(parts)
        self._ends = np.cumsum([len(part) for part in self.parts]).tolist()

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, index: int) -> str:
        part = bisect.bisect_right(self._ends, index)
        return self.parts[part][index - (self._ends[part - 1] if part else 0)]


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


READERS = {"jsonl": JsonlFile, "parquet": ParquetFile}
FORMATS = ("auto", "text", *READERS)  # data.format


def _format_of(path: pathlib.Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        return "jsonl"
    if path.is_file() and path.suffix == ".parquet":
        return "parquet"
    return "text"


def open_source(cfg: DataConfig) -> Source:
    """The documents named by cfg.source / cfg.format / cfg.file_pattern, cut to cfg.max_documents."""
    if cfg.source == "stdlib":
        source, where = stdlib_source(), "data.source='stdlib'"
    else:
        path = pathlib.Path(cfg.source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data.source={cfg.source!r} does not exist; data.source accepts {SOURCE_HELP}")
        fmt = _format_of(path, cfg.format)
        where = f"data.source={cfg.source!r}"
        files = [path]
        if path.is_dir():
            files = _list_files(path, cfg.file_pattern)
            where += f" with data.file_pattern={cfg.file_pattern!r}"
        if fmt == "text":
            source = TextFiles(files)
        elif fmt in READERS:
            parts = [READERS[fmt](f, cfg.text_field) for f in files]
            source = parts[0] if len(parts) == 1 else Concat(parts)
        else:
            raise DataError(f"data.format={cfg.format!r} is not allowed; choose one of {', '.join(FORMATS)}")
    if cfg.max_documents:
        source = Head(source, cfg.max_documents)
    if not any(source[i] for i in range(len(source))):
        raise DataError(f"empty corpus: {where} has no documents" + (" with any text" if len(source) else ""))
    return source
