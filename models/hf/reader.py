"""Reads safetensors files one tensor at a time with plain file reads (nothing memory-mapped).

safetensors' own numpy reader cannot return bfloat16 (numpy has no such dtype) and its flax reader holds two
to three copies of a tensor while converting it; reading a tensor's bytes at its header offsets and viewing them
with the ml_dtypes types costs exactly one copy of that tensor, whatever its dtype.
"""

from __future__ import annotations

import json
import math
import pathlib

import ml_dtypes
import numpy as np

# safetensors dtype name -> numpy dtype
DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsError(ValueError):
    """A .safetensors file cannot be read: it is truncated or not in the safetensors format (names the file)."""


class SafetensorsFile:
    """The header of one .safetensors file; `get(name)` reads one tensor. Opening checks that the file holds
    every byte its header lists (SafetensorsError if not)."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        file_bytes = self.path.stat().st_size
        not_safetensors = f"{self.path} is truncated or not a safetensors file"
        with open(self.path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            self.data_start = 8 + size
            if self.data_start > file_bytes:
                raise SafetensorsError(
                    f"{not_safetensors}: its header needs {self.data_start} bytes but the file holds {file_bytes}"
                )
            try:
                self.header = json.loads(f.read(size))
                self.header.pop("__metadata__", None)
                ends = [entry["data_offsets"][1] for entry in self.header.values()]
            except (ValueError, AttributeError, KeyError, IndexError, TypeError):  # not JSON, or not this layout
                raise SafetensorsError(f"{not_safetensors}: its header is not a safetensors header") from None
        data_end = self.data_start + max(ends, default=0)
        if data_end > file_bytes:
            raise SafetensorsError(
                f"{self.path} is truncated: its tensors end at byte {data_end} but the file holds {file_bytes} "
                f"bytes; copy or download it again"
            )

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as a numpy array of its stored dtype and shape."""
        entry = self.header[name]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: {name} has dtype {entry['dtype']}; readable: {', '.join(DTYPES)}")
        dtype = np.dtype(DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(entry["shape"]) * dtype.itemsize:
            raise ValueError(f"{self.path}: {name} holds {end - begin} bytes, not {entry['shape']} x {dtype}")
        data = np.fromfile(self.path, dtype=np.uint8, count=end - begin, offset=self.data_start + begin)
        return data.view(dtype).reshape(entry["shape"])
