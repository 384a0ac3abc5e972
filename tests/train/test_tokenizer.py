"""Tokenizers: byte round trip, a Hugging Face tokenizer.json built in-process, path errors."""

import pytest

from train.data.tokenizer import ByteTokenizer, HFTokenizer, make_tokenizer


def test_byte_round_trip_with_non_ascii():
    tok = make_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    text = "héllo, wörld ✓ 日本"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)


def test_byte_decode_skips_specials_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([tok.bos_id, *b"ab", tok.eos_id, tok.pad_id, 400]) == "ab"
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character


def test_hf_tokenizer_round_trip_and_special_ids(tokenizer_json):
    tok = make_tokenizer(str(tokenizer_json))
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "the lazy fox returns ünïcödé ✓"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
    assert max(ids) < tok.vocab_size <= 320


def test_hf_tokenizer_from_folder(tokenizer_json):
    assert make_tokenizer(str(tokenizer_json.parent)).eos_id == 2


def test_missing_tokenizer_names_path_and_choices(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="byte") as info:
        make_tokenizer(str(missing))
    assert str(missing) in str(info.value)
