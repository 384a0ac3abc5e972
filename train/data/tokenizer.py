"""Tokenizers: text <-> token ids, with the special ids (bos, eos, pad) the data pipeline needs.

`make_tokenizer("byte")` gives a 259-id byte tokenizer that needs no files; any other spec is a
Hugging Face `tokenizer.json` (or a folder holding one).
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Iterable

import tokenizers

from train.errors import DataError

BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<｜begin▁of▁sentence｜>")
EOS_TOKENS = ("<|end_of_text|>", "</s>", "<eos>", "<｜end▁of▁sentence｜>", "<|endoftext|>")
PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>")


class Tokenizer(abc.ABC):
    """Maps text to ids and back; `encode` adds no special tokens, `decode` drops them."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without bos/eos."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a list or a 1-D array); special ids are skipped, invalid UTF-8 is replaced."""


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes; 256 = pad, 257 = bos, 258 = eos."""

    vocab_size = 259
    pad_id = 256
    bos_id = 257
    eos_id = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Ids outside 0..255 (the specials, or ids past the vocabulary of a larger model) are skipped."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer loaded from a `tokenizer.json` file (DataError if it is not one).

    bos/eos are the first of BOS_TOKENS/EOS_TOKENS present in the vocabulary (None if none is);
    pad is the first of PAD_TOKENS present, else eos, else 0 (padding is masked out anyway).
    """

    def __init__(self, path: str | pathlib.Path):
        self.path = str(path)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(self.path)
        except Exception as error:  # noqa: BLE001 - the Rust library raises a bare Exception for any bad file
            raise DataError(
                f"data.tokenizer: {self.path} is not a Hugging Face tokenizer.json (tokenizers cannot read it: "
                f'{error}); data.tokenizer accepts "byte" or a path to a tokenizer.json (or a folder containing one)'
            ) from None
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._find(BOS_TOKENS)
        self.eos_id = self._find(EOS_TOKENS)
        pad_id = self._find(PAD_TOKENS)
        self.pad_id = pad_id if pad_id is not None else self.eos_id if self.eos_id is not None else 0

    def _find(self, candidates: tuple[str, ...]) -> int | None:
        for token in candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Ids outside the vocabulary are skipped, like the special tokens."""
        return self._tokenizer.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=True)


def make_tokenizer(spec: str) -> Tokenizer:
    """ "byte" -> ByteTokenizer; otherwise a path to a tokenizer.json or a folder that holds one."""
    if spec == "byte":
        return ByteTokenizer()
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f'data.tokenizer={spec!r}: {path} does not exist; data.tokenizer accepts "byte" or a path '
            f"to a Hugging Face tokenizer.json (or a folder containing one)"
        )
    return HFTokenizer(path)
