"""Where a document's stored text may be cut into pieces, so that a document of any size is read a piece at a time.

Stored text is UTF-8 bytes (a text file, a Parquet value) or the content of a JSON string (a JSONL line's text field,
between its quotes, escapes and all). A piece ends after a newline that a non-space follows, else before a space that
a non-space follows, else at the first character boundary: so no line, word, character, escape or surrogate pair is
split, and a tokenizer sees the words at a cut as it would in the whole text. A byte that is not valid UTF-8 reads as
U+FFFD in every kind of file, the first of each file logged as a warning (`decoded`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

log = logging.getLogger(__name__)
_REPLACED: set[str] = set()  # the files whose invalid UTF-8 was logged

PIECE_BYTES = 1 << 20  # a document is read and tokenized this many stored bytes at a time (about)
CUT_WINDOW = 1 << 16  # bytes searched past a piece's nominal end for a newline or a space to cut at

_TEXT_CUTS = (re.compile(rb"\n(?![\r\n\t ])"), re.compile(rb"(?= [^\r\n\t ])"))  # after the match: a line, a word
_JSON_CUTS = (re.compile(rb"\\n(?! |\\[nrt])"), re.compile(rb"(?= (?! |\\[nrt]))"))
_JSON_TOKEN = re.compile(rb"\\u[0-9a-fA-F]{4}|\\.|[^\\]", re.DOTALL)  # one character of JSON string content
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")


def _text_boundary(data: bytes, at: int) -> bool:
    """Whether UTF-8 `data` may be cut before byte `at` (not inside a character)."""
    return at >= len(data) or data[at] & 0xC0 != 0x80


def _json_boundary(data: bytes, at: int) -> bool:
    """Whether JSON string content `data` may be cut before byte `at`: not inside a UTF-8 character, an escape or
    a surrogate pair. The first backslash of a run always starts an escape, so the characters are read from there."""
    if at >= len(data):
        return True
    if not _text_boundary(data, at):
        return False
    char = data.rfind(b"\\", max(0, at - 6), at)  # an escape is at most 6 bytes: only one starting here can cover at
    if char < 0:
        return True
    while char > 0 and data[char - 1] == 0x5C:
        char -= 1
    last = char
    while char < at:
        last, char = char, _JSON_TOKEN.match(data, char).end()
    return char == at and not _HIGH_SURROGATE.fullmatch(data, last, at)


def _boundary(escaped: bool) -> Callable[[bytes, int], bool]:
    return _json_boundary if escaped else _text_boundary


def piece_end(data: bytes, size: int, escaped: bool) -> int:
    """Where a piece that starts at data[0] ends: the first cut at or past byte `size` after a newline, else before
    a word, within CUT_WINDOW bytes, else the first character boundary; len(data) if none. [escaped: JSON content]"""
    boundary = _boundary(escaped)
    for cut in _JSON_CUTS if escaped else _TEXT_CUTS:
        for match in cut.finditer(data, size, size + CUT_WINDOW):
            if match.end() < len(data) and boundary(data, match.start()):
                return match.end()
    return boundary_from(data, size, escaped)


def boundary_from(data: bytes, at: int, escaped: bool) -> int:
    """The first character boundary of `data` at or past byte `at` (len(data) if none)."""
    boundary = _boundary(escaped)
    return next((cut for cut in range(at, len(data)) if boundary(data, cut)), len(data))


def decoded(data: bytes, path: str, line: int | None = None) -> str:
    """`data`, bytes of the file at `path` (of its line `line`, where given), as UTF-8, each invalid byte read as
    U+FFFD; the first such byte of each file is logged, the file's later ones are not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        if path not in _REPLACED:
            _REPLACED.add(path)
            log.warning(
                "%s: invalid UTF-8 (byte 0x%02x) read as U+FFFD; later ones in this file are replaced without a word",
                path if line is None else f"{path}:{line}",
                data[error.start],
            )
        return data.decode("utf-8", errors="replace")


def decode(data: bytes, escaped: bool, path: str) -> str:
    """The text of stored bytes of the file at `path`, cut at character boundaries (see `decoded`)."""
    return json.loads('"' + decoded(data, path) + '"') if escaped else decoded(data, path)


def read_piece(
    fetch: Callable[[int, int], bytes], start: int, stop: int, size: int, escaped: bool, path: str
) -> tuple[str, int | None]:
    """The text of the piece of stored text [start, stop) that starts at `start`, about `size` bytes (all the rest
    when that is no more), and where the next piece starts (None: this one ends at `stop`). fetch(offset, count)
    reads stored bytes of the file at `path` (named if they are not UTF-8)."""
    if stop - start <= size:
        return decode(fetch(start, stop - start), escaped, path), None
    data = fetch(start, min(stop - start, size + CUT_WINDOW))
    end = piece_end(data, size, escaped)
    return decode(data[:end], escaped, path), (start + end if start + end < stop else None)


def tail_start(fetch: Callable[[int, int], bytes], extent: int, fraction: float, escaped: bool) -> int:
    """The stored byte where the last `fraction` of stored text of `extent` bytes starts, moved on to a character
    boundary; the tail holds at least one byte and leaves one where there are two."""
    if extent < 2:
        return extent
    at = extent - min(max(1, round(extent * fraction)), extent - 1)
    begin = max(0, at - CUT_WINDOW)  # context for the escape before `at`
    data = fetch(begin, min(extent, at + 16) - begin)
    return begin + boundary_from(data, at - begin, escaped)
