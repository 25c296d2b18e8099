"""The tensors of a GGUF file, read without its metadata.

`gguf.GGUFReader` parses every metadata field into numpy views, element by element: 2.7 s for
SmolLM2's 49K-token vocabulary and merges, which loading the weights never reads (the config and
tokenizer come from the converted folder, checkpoint/gguf_metadata.py). This walks past the
metadata (a string array is skipped by its lengths alone) to the tensor infos, and maps each
tensor's bytes from the file as they are. Layout: llama.cpp's GGUF v2/v3 specification.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from baton.checkpoint.model_config import CheckpointError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
# Value types of metadata fields: fixed sizes, and the two variable ones.
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF's order (the fastest-varying dimension first, so a matrix is
    (in_features, out_features)), and `data`, its bytes in the memory-mapped file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # uint8: [rows, bytes per row] for a block format, flat otherwise
    offset: int = 0  # where `data` starts in the file


def read_gguf_tensors(path: Path) -> list[GGUFTensor]:
    """Every tensor of the GGUF file at `path`; CheckpointError for a file that is not one."""
    try:
        buffer = np.memmap(path, dtype=np.uint8, mode="r")
        return _Parser(buffer).tensors()
    except (OSError, ValueError, struct.error, KeyError) as error:
        raise CheckpointError(f"{path}: not a readable GGUF file: {error}") from error


class _Parser:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.view = memoryview(buffer)
        self.offset = 0

    def tensors(self) -> list[GGUFTensor]:
        if bytes(self.view[:4]) != MAGIC:
            raise ValueError("no GGUF magic")
        self.offset = 4
        version, num_tensors, num_fields = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (2 or later)")
        alignment = DEFAULT_ALIGNMENT
        for _ in range(num_fields):
            key = self._string()
            (value_type,) = self._unpack("<I")
            if key == ALIGNMENT_KEY and value_type == _UINT32:
                (alignment,) = self._unpack("<I")
            else:
                self._skip_value(value_type)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            shape = self._unpack(f"<{num_dims}Q")
            tensor_type, offset = self._unpack("<IQ")
            infos.append((name, shape, GGMLQuantizationType(tensor_type), offset))
        start = -(-self.offset // alignment) * alignment
        return [self._tensor(start, *info) for info in infos]

    def _tensor(
        self,
        start: int,
        name: str,
        shape: tuple[int, ...],
        tensor_type: GGMLQuantizationType,
        offset: int,
    ) -> GGUFTensor:
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        row_bytes = shape[0] // block_size * type_size
        rows = int(np.prod(shape[1:], dtype=np.int64))
        data = self.buffer[start + offset : start + offset + rows * row_bytes]
        if data.size != rows * row_bytes:
            raise ValueError(f"tensor {name!r} is cut short: the file ends inside it")
        if block_size > 1:
            data = data.reshape(rows, row_bytes)
        shape = tuple(int(n) for n in shape)
        return GGUFTensor(name, shape, tensor_type, data, start + offset)

    def _unpack(self, layout: str) -> tuple:
        values = struct.unpack_from(layout, self.view, self.offset)
        self.offset += struct.calcsize(layout)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self.view[self.offset : self.offset + length]).decode("utf-8")
        self.offset += length
        return text

    def _skip_value(self, value_type: int) -> None:
        if value_type in _FIXED_SIZES:
            self.offset += _FIXED_SIZES[value_type]
        elif value_type == _STRING:
            (length,) = self._unpack("<Q")
            self.offset += length
        elif value_type == _ARRAY:
            element_type, count = self._unpack("<IQ")
            if element_type in _FIXED_SIZES:
                self.offset += count * _FIXED_SIZES[element_type]
            else:  # strings (or nested arrays): each element says how long it is
                for _ in range(count):
                    self._skip_value(element_type)
        else:
            raise ValueError(f"unknown metadata value type {value_type}")
