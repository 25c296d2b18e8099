"""The weights of a GGUF checkpoint (its config and tokenizer are checkpoint/gguf_metadata.py's):
dequantized in bulk (numpy, one call per tensor) by the `gguf` package into float32, or kept as
stored for the compact kernels, with llama.cpp's q/k row permutation undone for llama.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from baton.checkpoint.gguf_metadata import ROPE_FREQS_TENSOR
from baton.checkpoint.model_config import CheckpointError, ModelConfig
from baton.engine.native.formats import FORMATS, CompactWeight
from baton.engine.native.library import NativeKernels
from baton.engine.weights.gguf_file import GGUFTensor, read_gguf_tensors
from baton.engine.weights.gguf_names import (
    hf_tensor_name,
    permuted_heads,
    unpermute_rows,
)
from baton.engine.weights.load_progress import with_progress


def _tensors(gguf_file: Path) -> list[GGUFTensor]:
    stat = gguf_file.stat()
    return _cached_tensors(str(gguf_file), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _cached_tensors(gguf_file: str, size: int, mtime_ns: int) -> list[GGUFTensor]:
    """One read per file version: the weights are read twice at load, dequantized and as stored
    (`iter_gguf_compact_weights`). The tensors are views of the memory-mapped file, so keeping
    them costs address space, not memory."""
    return read_gguf_tensors(Path(gguf_file))


def forget_gguf_tensors() -> None:
    """Unmap the file read last: once the model holds its weights, the mapped pages it read
    would count in the process's resident memory a second time."""
    _cached_tensors.cache_clear()


def gguf_bytes_of_types(gguf_file: Path, formats: tuple[str, ...]) -> int:
    """The bytes of the file's matrices stored in `formats` (formats.py's names)."""
    return sum(
        tensor.data.nbytes
        for tensor in _tensors(gguf_file)
        if len(tensor.shape) == 2 and tensor.tensor_type.name.lower() in formats
    )


def unsupported_gguf_matrices(gguf_file: Path) -> list[tuple[str, str]]:
    """(name, type) of each matrix stored in a type the native kernels cannot multiply as
    stored (F32 matrices are multiplied as they are)."""
    return [
        (tensor.name, tensor.tensor_type.name)
        for tensor in _tensors(gguf_file)
        if len(tensor.shape) == 2
        and tensor.tensor_type.name != "F32"
        and tensor.tensor_type.name.lower() not in FORMATS
    ]


def iter_gguf_weights(
    gguf_file: Path,
    config: ModelConfig,
    native: NativeKernels | None = None,
    skip: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `gguf_file` under its HF name but those in `skip`, dequantized to
    float32, in HF's row order (see `_unpermute`). With `native`, the formats the compact
    kernels read are dequantized there (the same exact values, 4.1 s -> a few hundred ms for
    SmolLM2's 135M weights)."""
    import gguf

    for tensor in _with_progress(gguf_file, skip):
        if tensor.name == ROPE_FREQS_TENSOR:
            continue  # not a weight: the converted config's rope scaling
        try:
            name = hf_tensor_name(tensor.name)
        except KeyError:
            raise CheckpointError(f"{gguf_file}: unexpected tensor {tensor.name!r}") from None
        if name in skip:
            continue
        compact = _compact(tensor, name, config) if native is not None else None
        if compact is not None:
            yield name, native.dequantize(compact)  # type: ignore[union-attr]
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = _unpermute(values.reshape([int(n) for n in reversed(tensor.shape)]), name, config)
        # Copied only where numpy must: an F32 tensor is a read-only view of the file.
        yield name, torch.from_numpy(np.require(values, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


def iter_gguf_compact_weights(
    gguf_file: Path, config: ModelConfig
) -> Iterator[tuple[str, CompactWeight]]:
    """The matrices stored in a format the compact kernel reads (native/formats.py), as
    stored: the blocks of each row, rows in HF order (see `_unpermute`)."""
    for tensor in _with_progress(gguf_file):
        if tensor.name == ROPE_FREQS_TENSOR:
            continue
        name = hf_tensor_name(tensor.name)
        compact = _compact(tensor, name, config)
        if compact is not None:
            yield name, compact


def _with_progress(gguf_file: Path, skip: frozenset[str] = frozenset()) -> Iterator[GGUFTensor]:
    """The file's tensors but those whose HF names are in `skip`, with the load's progress
    (load_progress.py) by their bytes."""
    tensors = [
        tensor for tensor in _tensors(gguf_file) if _hf_name_or_none(tensor.name) not in skip
    ]
    return with_progress(
        ((tensor, tensor.data.nbytes) for tensor in tensors),
        sum(tensor.data.nbytes for tensor in tensors),
        f"loading {gguf_file.name}",
    )


def _hf_name_or_none(gguf_name: str) -> str | None:
    try:
        return hf_tensor_name(gguf_name)
    except KeyError:
        return None  # (the loaders name it in their error, or skip it: rope_freqs)


def _compact(tensor: GGUFTensor, hf_name: str, config: ModelConfig) -> CompactWeight | None:
    """A GGUF tensor as stored, if it is a matrix in a format the compact kernels read."""
    compact_format = tensor.tensor_type.name.lower()
    if compact_format not in FORMATS or len(tensor.shape) != 2:
        return None
    in_features, out_features = (int(n) for n in tensor.shape)
    if in_features % FORMATS[compact_format].block:
        return None
    rows = _unpermute(
        np.asarray(tensor.data).view(np.uint8).reshape(out_features, -1), hf_name, config
    )
    data = torch.from_numpy(np.array(rows, dtype=np.uint8, order="C"))
    return CompactWeight(compact_format, data, in_features)


def _unpermute(rows: np.ndarray, hf_name: str, config: ModelConfig) -> np.ndarray:
    """A tensor's rows in HF's order: llama.cpp's converter interleaved a llama's q and k rows
    (weights and biases) for its RoPE; every other tensor is stored in HF's order."""
    if config.architecture != "LlamaForCausalLM":
        return rows
    heads = permuted_heads(hf_name, config.num_heads, config.num_kv_heads)
    return unpermute_rows(rows, heads) if heads else rows
