"""The built-in `retrieval` source: documents are needle haystacks of data.seq_len - 1 bytes, each built alone and
the same every time, that end with the value of the asked needle; it reads, pickles and sizes like any source."""

import pickle
import re

import numpy as np
import pytest

from train.config import DataConfig
from train.data.retrieval import DOCUMENTS
from train.data.sources import open_source
from train.errors import DataError

NEEDLE = re.compile(r" The special magic number for (\S+) is (\d+)\. ")
QUESTION = re.compile(r" What (?:is|are all) the special magic numbers? for (\S+)\? (?:It is|They are) ([\d, ]+)$")


def retrieval(seq_len=256, **fields):
    return open_source(DataConfig(source="retrieval", seq_len=seq_len, **fields))


def answer(document: str) -> tuple[list[str], list[str]]:
    """(the values of the asked key's needles in row order, the answered values) of a document."""
    key, answered = QUESTION.search(document).groups()
    return [value for k, value in NEEDLE.findall(document) if k == key], answered.split(", ")


@pytest.mark.parametrize("seq_len", [256, 1024])
def test_documents_hold_the_needles_the_answer_names(seq_len):
    source = retrieval(seq_len)
    documents = [source[i] for i in range(40)]
    assert len(source) == DOCUMENTS
    assert np.array_equal(source.sizes(), np.full(DOCUMENTS, seq_len - 1))
    assert [len(d.encode()) for d in documents] == [seq_len - 1] * 40
    for document in documents:
        values, answered = answer(document)
        assert values and answered == values, document
    needles = {len(NEEDLE.findall(d)) for d in documents}
    assert needles == ({1} if seq_len == 256 else {1, 4})  # four needles fit from 511 bytes on


def test_documents_are_the_same_each_time_in_any_order_and_after_pickling():
    source = retrieval()
    forward = [source[i] for i in (0, 1, 2, 99_999)]
    again = pickle.loads(pickle.dumps(source))
    assert [again[i] for i in (99_999, 2, 1, 0)] == forward[::-1]
    assert len(set(forward)) == 4


def test_max_documents_and_bad_lengths():
    assert len(retrieval(max_documents=10)) == 10
    with pytest.raises(IndexError, match="100000"):
        retrieval()[DOCUMENTS]
    with pytest.raises(DataError, match=r"data.seq_len >= 128; got data.seq_len=64"):
        retrieval(64)
