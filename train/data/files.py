"""The stored file kinds a source reads: text files (a file is one document), JSON lines (one object per line) and
Parquet (one row per document); a folder's files listed, and text told from binary by a file's head.

Each kind reads a document whole or a piece at a time (`read`, cut as train/data/cuts.py says) from any place in its
stored text (the bytes of a text file or a Parquet value, the content of a JSON line's text string), and says where
its last fraction begins (`tail_start`). Every JSON line is parsed when its file is indexed; a file that cannot be
read is a DataError naming it (and the line). Readers hold paths and small indexes and pickle without open files.
"""

from __future__ import annotations

import codecs
import functools
import json
import json.scanner
import logging
import os
import pathlib
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from train.data import cuts
from train.errors import DataError

SNIFF_BYTES = 8192  # a text file's head read when its folder is listed, to tell text from binary
NOT_TEXT_SHARE = 0.01  # a head with more invalid UTF-8 than this share is not UTF-8 text (fewer: stray bytes)
JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}

log = logging.getLogger(__name__)


def _unreadable(what: str, error: Exception) -> DataError:
    """The error for a file or folder (`what`, naming its path) that could not be read."""
    if isinstance(error, OSError):
        return DataError(
            f"cannot read {what}: {error.strerror or error}; data.source and everything in it must be readable"
        )
    return DataError(f"cannot read {what}: {error}")


def read_bytes(path: str, start: int = 0, size: int = -1) -> bytes:
    """`size` bytes (-1: all) of the file at `path` from byte `start`; an OSError becomes a DataError naming it."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(size)
    except OSError as error:
        raise _unreadable(path, error) from None


def _read_at(path: str, base: int, start: int, size: int) -> bytes:
    """`size` bytes of the file at `path` from byte `base` + `start` (_read with an origin)."""
    return read_bytes(path, base + start, size)


_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_scan_json_value = json.scanner.make_scanner(json.JSONDecoder())


def _field_content(line: bytes, field: str) -> tuple[int, int]:
    """Bytes [begin, end) of `line`, a JSON object checked to hold the string field `field`, between that string's
    quotes (its last occurrence when the key repeats, as json.loads reads it)."""
    text = line.decode("utf-8", errors="surrogateescape")  # an invalid byte stays one character: offsets hold
    at, found = _JSON_SPACE.match(text).end() + 1, (0, 0)
    while text[at := _JSON_SPACE.match(text, at).end()] != "}":
        key, at = json.decoder.scanstring(text, at + 1)
        at = _JSON_SPACE.match(text, _JSON_SPACE.match(text, at).end() + 1).end()  # past the colon
        _, end = _scan_json_value(text, at)
        if key == field:
            found = (at, end)
        at = _JSON_SPACE.match(text, end).end()
        at += text[at] == ","
    begin = len(text[: found[0]].encode(errors="surrogateescape")) + 1
    return begin, len(line) - len(text[found[1] :].encode(errors="surrogateescape")) - 1


def _unreadable_folder(error: OSError) -> None:
    """os.walk's onerror: an unreadable folder stops the listing instead of being skipped."""
    raise _unreadable(f"folder {error.filename}", error) from None


def list_files(root: pathlib.Path, pattern: str, skip_dirs: frozenset[str] = frozenset()) -> list[pathlib.Path]:
    """Files under `root` at any depth whose path matches `pattern` (from the right, like
    `PurePath.match`: "*.txt", "train/*.jsonl"), sorted; hidden entries and `skip_dirs` are skipped,
    an unreadable folder is a DataError."""
    found = []
    for folder, dirs, files in os.walk(root, onerror=_unreadable_folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip_dirs]
        for name in files:
            path = pathlib.Path(folder, name)
            if not name.startswith(".") and path.relative_to(root).match(pattern) and path.is_file():
                found.append(path)
    return sorted(found)


def _invalid_utf8(data: bytes, final: bool, limit: int) -> tuple[int, int | None]:
    """(how many bytes of `data` are not valid UTF-8, counted up to just past `limit`; the offset of the first or
    None); a character cut at the end is valid unless `final`."""
    count, first, at = 0, None, 0
    decoder = codecs.getincrementaldecoder("utf-8")()
    while count <= limit:
        try:
            decoder.decode(data[at:], final=final)
            break
        except UnicodeDecodeError as error:
            first = at + error.start if first is None else first
            count += error.end - error.start
            at += error.end
            decoder.reset()
    return count, first


def _not_text(path: pathlib.Path) -> str | None:
    """Why the file at `path` is not UTF-8 text, judged by its first SNIFF_BYTES bytes (a NUL byte, or more than
    NOT_TEXT_SHARE of them invalid UTF-8: binary or another encoding), or None when it is text (a few stray bytes
    read as U+FFFD, see cuts.decoded)."""
    head = read_bytes(str(path), size=SNIFF_BYTES)
    if (nul := head.find(b"\0")) >= 0:
        return f"NUL byte at offset {nul}"
    limit = int(NOT_TEXT_SHARE * len(head))
    invalid, first = _invalid_utf8(head, final=len(head) < SNIFF_BYTES, limit=limit)
    if invalid > limit:
        share = f"more than {NOT_TEXT_SHARE:.0%} of its first {len(head)} bytes invalid"
        return f"not UTF-8 ({share}, the first 0x{head[first]:02x} at offset {first})"
    return None


def text_only(paths: Sequence[pathlib.Path]) -> tuple[list[pathlib.Path], str]:
    """The paths of UTF-8 text files (see _not_text), and a note on the others ("" if none), also logged."""
    kept, skipped = [], []
    for path in paths:
        reason = _not_text(path)
        if reason is None:
            kept.append(path)
        else:
            skipped.append(f"{path}: {reason}")
    note = ""
    if skipped:
        note = f"skipped {len(skipped)} of {len(paths)} files that are not UTF-8 text (binary or another encoding), "
        note += f"e.g. {skipped[0]}"
        log.warning("%s", note)
    return kept, note


class TextFiles:
    """Each file is one document, decoded as UTF-8 with invalid bytes replaced (open_source and
    stdlib_source pass only files whose head is UTF-8 text, so only stray bytes are replaced, see cuts.decoded).
    Its stored text is the file's bytes."""

    def __init__(self, paths: Sequence[pathlib.Path | str]):
        self.paths = [str(path) for path in paths]
        self.file_sizes = np.asarray([os.path.getsize(path) for path in self.paths], np.int64)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} out of range for {len(self)} documents")
        return cuts.decoded(read_bytes(self.paths[index]), self.paths[index])

    def sizes(self) -> np.ndarray:
        return self.file_sizes.copy()

    def read(self, index: int, start: int, stop: int | None, size: int) -> tuple[str, int | None]:
        stop = int(self.file_sizes[index]) if stop is None else stop
        fetch = functools.partial(read_bytes, self.paths[index])
        return cuts.read_piece(fetch, start, stop, size, escaped=False, path=self.paths[index])

    def tail_start(self, index: int, fraction: float) -> int:
        fetch = functools.partial(read_bytes, self.paths[index])
        return cuts.tail_start(fetch, int(self.file_sizes[index]), fraction, escaped=False)


class JsonlFile:
    """One JSON object per line; the document is `obj[text_field]`, a string. Blank lines are skipped.

    Indexing reads the file once, line by line, and checks every line (DataError naming file:line);
    it keeps each document's line start offset, length in bytes and line number (int64 [num_docs] each),
    and for a line longer than cuts.PIECE_BYTES where its text's content lies, so that it is read in pieces.
    Each read seeks to its line. The stored text is the content of the JSON string, between its quotes.
    """

    def __init__(self, path: pathlib.Path | str, text_field: str):
        self.path = str(path)
        self.text_field = text_field
        starts, lengths, numbers = array("q"), array("q"), array("q")
        self._long: dict[int, tuple[int, int]] = {}  # document -> (file offset, length) of its text's content
        offset = 0
        try:
            with open(self.path, "rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        self._text(line, number)
                        if len(line) > cuts.PIECE_BYTES:
                            begin, end = _field_content(line, text_field)
                            self._long[len(starts)] = (offset + begin, end - begin)
                        starts.append(offset)
                        lengths.append(len(line))
                        numbers.append(number)
                    offset += len(line)
        except OSError as error:
            raise _unreadable(self.path, error) from None
        self._starts, self._lengths, self._line_numbers = (
            np.frombuffer(a, np.int64) for a in (starts, lengths, numbers)
        )

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, index: int) -> str:
        return self._text(self._line(index), int(self._line_numbers[index]))

    def sizes(self) -> np.ndarray:
        return self._lengths.copy()  # the whole line: the text and its JSON around it

    def read(self, index: int, start: int, stop: int | None, size: int) -> tuple[str, int | None]:
        if start == 0 and stop is None and self._lengths[index] <= size:  # the whole text: one piece
            return self[index], None
        begin, length = self._content(index)
        fetch = functools.partial(_read_at, self.path, begin)
        return cuts.read_piece(fetch, start, length if stop is None else stop, size, escaped=True, path=self.path)

    def tail_start(self, index: int, fraction: float) -> int:
        begin, length = self._content(index)
        return cuts.tail_start(functools.partial(_read_at, self.path, begin), length, fraction, escaped=True)

    def _line(self, index: int) -> bytes:
        return read_bytes(self.path, int(self._starts[index]), int(self._lengths[index]))

    def _content(self, index: int) -> tuple[int, int]:
        """(file offset, length in bytes) of document `index`'s text content: indexed for a long line, else found
        in its line."""
        if index in self._long:
            return self._long[index]
        begin, end = _field_content(self._line(index), self.text_field)
        return int(self._starts[index]) + begin, end - begin

    def _text(self, line: bytes, number: int) -> str:
        """The document on `line`, line `number` of the file; a DataError naming file:line if the line is not a
        JSON object with a string field text_field."""
        where = f"{self.path}:{number}"
        expected = f"each line must be a JSON object with a string field {self.text_field!r} (data.text_field)"
        try:
            obj = json.loads(cuts.decoded(line, self.path, number))  # a str parses faster than bytes
        except json.JSONDecodeError as error:
            shown = line.decode("utf-8", errors="replace").strip()
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise DataError(
                f"{where}: not valid JSON ({error.msg} at column {error.colno}) in {shown!r}; {expected}"
            ) from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a JSON {JSON_TYPES.get(type(obj), 'null')}; {expected}")
        if self.text_field not in obj:
            raise DataError(f"{where}: no field {self.text_field!r} (data.text_field); keys present: {sorted(obj)}")
        text = obj[self.text_field]
        if not isinstance(text, str):
            kind = JSON_TYPES.get(type(text), "null")
            raise DataError(f"{where}: field {self.text_field!r} is a JSON {kind}; {expected}")
        return text


class ParquetFile:
    """Column `text_field` of a Parquet file, one document per row.

    Rows are located by (row group, row); the last `cache_groups` row groups read are kept, as Arrow arrays (a
    value is read in pieces from its Arrow buffer). The stored text is the value's UTF-8 bytes.
    """

    def __init__(self, path: pathlib.Path | str, text_field: str, cache_groups: int = 2):
        self.path = str(path)
        self.text_field = text_field
        self.cache_groups = cache_groups
        metadata = self._parquet()
        columns = metadata.schema_arrow.names
        if text_field not in columns:
            raise DataError(f"{self.path} has no column {text_field!r} (data.text_field); available columns: {columns}")
        counts = [metadata.metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._group_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._sizes: np.ndarray | None = None
        self._open()

    def _parquet(self) -> pq.ParquetFile:
        """The file opened for reading; a DataError naming it if it cannot be read or is not Parquet."""
        try:
            return pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as error:
            raise _unreadable(f"{self.path} as Parquet", error) from None

    def _open(self) -> None:
        self._file: pq.ParquetFile | None = None
        self._cache: OrderedDict[int, pa.Array] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_file", "_cache", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return int(self._group_starts[-1])

    def _row_group(self, group: int) -> pa.Array:
        with self._lock:
            if group in self._cache:
                self._cache.move_to_end(group)
                return self._cache[group]
            if self._file is None:
                self._file = self._parquet()
            try:
                rows = self._file.read_row_group(group, columns=[self.text_field]).column(0).combine_chunks()
            except (OSError, pa.ArrowException) as error:
                raise _unreadable(f"{self.path} row group {group}", error) from None
            self._cache[group] = rows
            while len(self._cache) > self.cache_groups:
                self._cache.popitem(last=False)
            return rows

    def sizes(self) -> np.ndarray:
        """Read once, column only (Parquet stores the strings' lengths with them)."""
        if self._sizes is None:
            try:
                column = self._parquet().read(columns=[self.text_field]).column(0)
            except (OSError, pa.ArrowException) as error:
                raise _unreadable(f"{self.path} as Parquet", error) from None
            self._sizes = pc.fill_null(pc.binary_length(column), 0).to_numpy().astype(np.int64)
        return self._sizes

    def __getitem__(self, index: int) -> str:
        return self._value(index).as_py()

    def read(self, index: int, start: int, stop: int | None, size: int) -> tuple[str, int | None]:
        value = self._value(index).as_buffer()
        stop = value.size if stop is None else stop
        return cuts.read_piece(_buffer_reader(value), start, stop, size, escaped=False, path=self.path)

    def tail_start(self, index: int, fraction: float) -> int:
        value = self._value(index).as_buffer()
        return cuts.tail_start(_buffer_reader(value), value.size, fraction, escaped=False)

    def _value(self, index: int) -> pa.Scalar:
        """Row `index`'s value, a string (DataError naming the row if it holds anything else)."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} out of range for {self.path} with {len(self)} rows")
        group = int(np.searchsorted(self._group_starts, index, side="right")) - 1
        value = self._row_group(group)[index - int(self._group_starts[group])]
        if not (value.is_valid and (pa.types.is_string(value.type) or pa.types.is_large_string(value.type))):
            raise DataError(
                f"{self.path} row {index}: column {self.text_field!r} holds {type(value.as_py()).__name__}; "
                "expected a string"
            )
        return value


def _buffer_reader(buffer: pa.Buffer):
    """fetch(offset, count) -> bytes of `buffer` (cuts.read_piece's reader of stored bytes)."""
    return lambda offset, count: buffer[offset : offset + count].to_pybytes()


READERS = {"jsonl": JsonlFile, "parquet": ParquetFile}
