"""The Hugging Face files a model came with: an import's hf_config.json (its config.json) and tokenizer.json. A run
initialised from an import (or from a run that was) keeps them in its run directory, and export reads them back from
a checkpoint's own directory or its run's, so an exported fine-tune keeps the import's token ids and tokenizer."""

from __future__ import annotations

import pathlib
import shutil

from train.config.imported import HF_CONFIG, TOKENIZER

FILES = (HF_CONFIG, TOKENIZER)


def _homes(path: str | pathlib.Path) -> list[pathlib.Path]:
    """`path` (an import, a run's checkpoints/ or checkpoints/<step>), then its run directory when it is a run's."""
    path = pathlib.Path(path).absolute()
    if path.name == "checkpoints":
        return [path, path.parent]
    if path.parent.name == "checkpoints":
        return [path, path.parent.parent]
    return [path]


def origin_file(path: str | pathlib.Path, name: str) -> pathlib.Path | None:
    """The file `name` (one of FILES) that checkpoint `path` came with, or None."""
    return next((home / name for home in _homes(path) if (home / name).is_file()), None)


def keep_origin(init_from: str | pathlib.Path, run_directory: pathlib.Path) -> None:
    """Copies the FILES that `init_from` came with into `run_directory`."""
    for name in FILES:
        source = origin_file(init_from, name)
        if source is not None and source.absolute() != (run_directory / name).absolute():
            shutil.copyfile(source, run_directory / name)
