"""What a data position depends on, saved with each checkpoint and compared on resume: a position in a stream is
replayed only on the data it was saved on, never silently on other data.

A record is plain JSON, made when the run opens its source:
    files      {path: [size, head hash, tail hash]}  each stored file a source reads; the hashes are of its first
                                                     and last ENDS_BYTES bytes (a cheap fingerprint, not a checksum)
    documents  int                                  the documents the source holds
    tokenizer  str                                  "byte", or the sha256 of the tokenizer.json

The settings that shape the stream (packing, seq_len, the split, the seed) are the run config's data section, which
a resumed run keeps (train/loop.py). `compare` tells growth (files added, files appended to: their old bytes are
still their first ones; more documents) from any other change, for data.on_change: "refuse" (the default) stops the
resume in one line naming the change and the ways on, "grown" accepts growth only, "restart" any change; both keep
the model, optimizer and step and start the data position fresh over the data as it is now (the grown corpus read
from its beginning, in a new order where shuffled).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

from train.data.files import JsonlFile, ParquetFile, TextFiles, read_bytes
from train.data.sources import Concat, Head, Source
from train.data.tokenizer import HFTokenizer, Tokenizer
from train.errors import DataError

log = logging.getLogger(__name__)

ENDS_BYTES = 4096
ON_CHANGE = ("refuse", "grown", "restart")  # data.on_change: which changes a resume accepts (none, growth, any)


def _stored_files(source: Source) -> list[str]:
    """The paths of the stored files `source` reads, in its order; none for a synthetic source."""
    if isinstance(source, TextFiles):
        return list(source.paths)
    if isinstance(source, (JsonlFile, ParquetFile)):
        return [source.path]
    if isinstance(source, Concat):
        return [path for part in source.parts for path in _stored_files(part)]
    if isinstance(source, Head):
        return _stored_files(source.source)
    return []


def _hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _ends(path: str, size: int) -> list[str]:
    """[head hash, tail hash] of the first `size` bytes of the file at `path`."""
    ends = min(size, ENDS_BYTES)
    return [_hash(read_bytes(path, 0, ends)), _hash(read_bytes(path, size - ends, ends))]


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """ "byte", or the sha256 of a Hugging Face tokenizer's tokenizer.json."""
    if isinstance(tokenizer, HFTokenizer):
        return hashlib.sha256(read_bytes(tokenizer.path)).hexdigest()
    return "byte"


def data_record(source: Source, tokenizer: Tokenizer) -> dict:
    """The record (module docstring) of the data a run reads from `source` with `tokenizer`."""
    files = {}
    for path in _stored_files(source):
        size = os.path.getsize(path)
        files[path] = [size, *_ends(path, size)]
    return {"files": files, "documents": len(source), "tokenizer": tokenizer_hash(tokenizer)}


@dataclasses.dataclass
class Changes:
    """How the data differs from a saved record: `grown` (files added or appended to, more documents) and `other`
    (anything else), each a list of phrases."""

    grown: list[str]
    other: list[str]

    def __bool__(self) -> bool:
        return bool(self.grown or self.other)

    def __str__(self) -> str:
        return "; ".join(self.other + self.grown)


def _some(paths: list[str], what: str) -> str:
    """'N files WHAT (e.g. PATH)'."""
    return f"{len(paths)} file{'s' * (len(paths) != 1)} {what} (e.g. {paths[0]})"


def _appended(path: str, saved: list) -> bool:
    """Whether the file at `path`, longer now, still begins with the bytes recorded as `saved`."""
    size = saved[0]
    return _ends(path, size) == saved[1:]


def compare(saved: dict, now: dict) -> Changes:
    """How the data recorded `now` differs from the `saved` record (see Changes)."""
    changes = Changes([], [])
    before, after = saved["files"], now["files"]
    removed = [path for path in before if path not in after]
    added = [path for path in after if path not in before]
    edited = [path for path in before if path in after and before[path] != after[path]]
    appended = [path for path in edited if after[path][0] > before[path][0] and _appended(path, before[path])]
    rewritten = [path for path in edited if path not in appended]
    if removed:
        changes.other.append(_some(removed, "removed"))
    if rewritten:
        path = rewritten[0]
        sizes = f"{before[path][0]} -> {after[path][0]} bytes" if before[path][0] != after[path][0] else "same size"
        changes.other.append(_some(rewritten, "changed") + f", {sizes}, other bytes")
    if added:
        changes.grown.append(_some(added, "added"))
    if appended:
        path = appended[0]
        changes.grown.append(_some(appended, "appended to") + f", {before[path][0]} -> {after[path][0]} bytes")
    if saved["documents"] != now["documents"]:
        (changes.grown if now["documents"] > saved["documents"] else changes.other).append(
            f"documents: {saved['documents']} -> {now['documents']}"
        )
    if saved["tokenizer"] != now["tokenizer"]:
        changes.other.append(f"the tokenizer: {saved['tokenizer'][:12]} -> {now['tokenizer'][:12]}")
    return changes


def resumes_position(saved: dict | None, now: dict, on_change: str, where: str) -> bool:
    """Whether a resume takes the data position saved with `saved` (the record of checkpoint `where`; None in one
    saved before records were kept: not checked) on the data recorded `now`; False: the data changed and
    `on_change` accepts it, so the position starts fresh. Raises DataError naming the change and the ways on when
    it does not accept it."""
    if saved is None:
        return True
    changes = compare(saved, now)
    if not changes:
        return True
    if on_change == "restart" or (on_change == "grown" and not changes.other):
        log.warning(
            "the data changed since %s was saved (%s); data.on_change=%s: the model, optimizer and step go on, and "
            "the data position starts fresh over the data as it is now",
            where,
            changes,
            on_change,
        )
        return False
    choices = "data.on_change=restart" if changes.other else "data.on_change=grown (or =restart)"
    raise DataError(
        f"the data changed since {where} was saved ({changes}): its data position belongs to the data as it was. "
        f"Restore the data to resume exactly, or set {choices} to keep the model, optimizer and step and start the "
        f"data position fresh over the data as it is now"
    )
