"""Minimal safetensors reader/writer on numpy (bfloat16 via ml_dtypes, files memory-mapped).

Format: an 8-byte little-endian header length, a JSON header mapping each tensor name to its
dtype, shape and [begin, end) byte offsets into the data section that follows.
Reading memory-maps the file, so a tensor is only paged in when converted.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one ``.safetensors`` file: `shapes` from the header, `get(name)` -> numpy."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        self._data_start = 8 + header_len
        header.pop("__metadata__", None)
        self._entries = header
        self._mmap = None

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        dtype_name = entry["dtype"]
        if dtype_name not in _DTYPES:
            raise ValueError(f"tensor {name!r} in {self.path} has unsupported dtype {dtype_name!r}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(_DTYPES[dtype_name]).reshape(entry["shape"])


def save_file(
    tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: dict | None = None
) -> None:
    """Writes `tensors` (name -> numpy array) to one safetensors file, in the given order."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    arrays = []
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        if array.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype} that safetensors cannot store")
        header[name] = {
            "dtype": _NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep the data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for array in arrays:
            f.write(array.tobytes())
