"""Fixtures of the train tests: `library_file`, the library log of one test."""

import pathlib

import pytest

from train.process import library_log


@pytest.fixture
def library_file(tmp_path, monkeypatch) -> pathlib.Path:
    """The library log's file for one test, tmp_path/library.log: what the test leaves there stays out of the error
    lines of the tests after it in this process."""
    path = tmp_path / "library.log"
    monkeypatch.setattr(library_log._log, "path", path)
    monkeypatch.setattr(library_log._log, "written", False)
    return path
