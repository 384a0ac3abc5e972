"""The tensors a Hugging Face model directory stores, by name: model.safetensors, or an index and its shards. A tensor
stored in MXFP4 (X_blocks + X_scales, models/hf/mxfp4.py) is listed and read as X, dequantized."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from models.hf import mxfp4
from models.hf.reader import SafetensorsFile

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_map(path: pathlib.Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from model.safetensors.index.json or the single model.safetensors."""
    if (path / INDEX).is_file():
        return json.loads((path / INDEX).read_text())["weight_map"]
    if (path / SINGLE).is_file():
        return dict.fromkeys(SafetensorsFile(path / SINGLE).keys(), SINGLE)
    raise FileNotFoundError(f"{path} holds neither {SINGLE} nor {INDEX}")


class StoredTensors:
    """`files`: tensor name -> the file it is read from (an MXFP4 tensor's: its blocks' file); `stored_files`: what
    the directory stores (MXFP4 parts included); `get(name)` reads one tensor (each file's header is read once)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        stored = weight_map(path)
        self.packed = mxfp4.packed(stored)
        parts = {part for pair in self.packed.values() for part in pair}
        self.files = {name: file for name, file in stored.items() if name not in parts}
        self.files.update({name: stored[blocks] for name, (blocks, _) in self.packed.items()})
        self.stored_files = stored
        self.readers: dict[str, SafetensorsFile] = {}

    def _reader(self, file: str) -> SafetensorsFile:
        if file not in self.readers:
            self.readers[file] = SafetensorsFile(self.path / file)
        return self.readers[file]

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as stored (dtype and shape), or dequantized to float32 when stored in MXFP4."""
        if name not in self.packed:
            return self._reader(self.files[name]).get(name)
        blocks, scales = self.packed[name]
        return mxfp4.dequantize(
            self._reader(self.stored_files[blocks]).get(blocks), self._reader(self.stored_files[scales]).get(scales)
        )
