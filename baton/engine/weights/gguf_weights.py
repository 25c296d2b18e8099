"""The weights of a GGUF checkpoint (its config and tokenizer are checkpoint/gguf_metadata.py's):
dequantized in bulk (numpy, one call per tensor) by the `gguf` package into float32, or kept as
stored for the compact kernels, with llama.cpp's q/k row permutation undone for llama and
Gemma's norms as its checkpoints store them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from baton.checkpoint.gemma_config import GEMMA_NORM_SHIFT
from baton.checkpoint.gguf_config import ROPE_TENSORS
from baton.checkpoint.model_config import CheckpointError, ModelConfig
from baton.engine.native.formats import FORMATS, CompactWeight
from baton.engine.native.library import NativeKernels
from baton.engine.weights.fused_tensors import part_names, unfused
from baton.engine.weights.gguf_file import GGUFTensor, read_gguf_tensors
from baton.engine.weights.gguf_names import (
    LLAMA_CPP_PERMUTED,
    hf_tensor_names,
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
    """The bytes of the file's matrices (a mixture of experts' stacked ones too) stored in
    `formats` (formats.py's names)."""
    return sum(
        tensor.data.nbytes
        for tensor in _tensors(gguf_file)
        if len(tensor.shape) >= 2 and tensor.tensor_type.name.lower() in formats
    )


def unsupported_gguf_matrices(gguf_file: Path) -> list[tuple[str, str]]:
    """(name, type) of each matrix stored in a type the native kernels cannot multiply as
    stored (F32 matrices are multiplied as they are)."""
    return [
        (tensor.name, tensor.tensor_type.name)
        for tensor in _tensors(gguf_file)
        if len(tensor.shape) >= 2
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
    float32, in HF's row order (see `_unpermute`); a stacked tensor of experts as each
    expert's, a fused one (Phi-3's) cut into its parts. With `native`, the formats the compact
    kernels read are dequantized there (the same exact values, 4.1 s -> a few hundred ms for
    SmolLM2's 135M weights)."""
    for name, weight in unfused(config, _dequantized(gguf_file, config, native, skip)):
        if name not in skip:
            yield name, weight


def _dequantized(
    gguf_file: Path, config: ModelConfig, native: NativeKernels | None, skip: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    for tensor in _with_progress(gguf_file, config, skip):
        names = _hf_names(gguf_file, tensor, config)
        compacts = _compact(gguf_file, tensor, names, config) if native is not None else None
        if compacts is not None:
            for name, compact in zip(names, compacts):
                if name not in skip:
                    yield name, native.dequantize(compact)  # type: ignore[union-attr]
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = [int(n) for n in reversed(tensor.shape)]
        # (A stacked tensor of experts is [experts, out, in]: each expert's slice one weight.)
        weights = values.reshape(shape) if len(shape) == 3 else values.reshape(1, *shape)
        for name, weight in zip(names, weights):
            if name in skip:
                continue
            weight = _unpermute(weight, name, config)
            if name.endswith("shared_expert_gate.weight"):
                weight = weight.reshape(1, -1)  # HF's [1, hidden], which llama.cpp may flatten
            if config.gemma is not None and name.endswith("norm.weight"):
                # llama.cpp's converter stored Gemma's 1 + w, and loading adds the 1 back:
                # the file's value exactly where it is at least 0.5 (float32 subtracts 1 from
                # those exactly), below within a rounding of w, as transformers' GGUF loader
                # computes it.
                weight = weight - GEMMA_NORM_SHIFT
            # Copied only where numpy must: an F32 tensor is a read-only view of the file.
            yield (
                name,
                torch.from_numpy(np.require(weight, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])),
            )


def iter_gguf_compact_weights(
    gguf_file: Path, config: ModelConfig
) -> Iterator[tuple[str, CompactWeight]]:
    """The matrices stored in a format the compact kernel reads (native/formats.py), as
    stored: the blocks of each row, rows in HF order (see `_unpermute`); a stacked tensor of
    experts as each expert's, a fused one cut into its parts."""
    for tensor in _with_progress(gguf_file, config):
        names = _hf_names(gguf_file, tensor, config)
        yield from unfused(config, zip(names, _compact(gguf_file, tensor, names, config) or ()))


def _hf_names(gguf_file: Path, tensor: GGUFTensor, config: ModelConfig) -> list[str]:
    """The HF names of a tensor of the file (each expert's for a stacked one)."""
    try:
        return hf_tensor_names(tensor.name, config)
    except KeyError:
        raise CheckpointError(f"{gguf_file}: unexpected tensor {tensor.name!r}") from None


def _with_progress(
    gguf_file: Path, config: ModelConfig, skip: frozenset[str] = frozenset()
) -> Iterator[GGUFTensor]:
    """The file's weights (not llama.cpp's RoPE factors, which are the config's) but those
    whose HF names are all in `skip`, with the load's progress (load_progress.py) by their
    bytes."""
    tensors = [
        tensor
        for tensor in _tensors(gguf_file)
        if tensor.name not in ROPE_TENSORS
        and not set(_hf_names_or_none(tensor.name, config)) <= skip
    ]
    return with_progress(
        ((tensor, tensor.data.nbytes) for tensor in tensors),
        sum(tensor.data.nbytes for tensor in tensors),
        f"loading {gguf_file.name}",
    )


def _hf_names_or_none(gguf_name: str, config: ModelConfig) -> list[str | None]:
    """The HF names of a tensor's weights (a fused tensor's parts')."""
    try:
        names = hf_tensor_names(gguf_name, config)
    except KeyError:
        return [None]  # (the loaders name it in their error)
    return [part for name in names for part in part_names(config, name)]


def _compact(
    gguf_file: Path, tensor: GGUFTensor, names: list[str], config: ModelConfig
) -> list[CompactWeight] | None:
    """A GGUF matrix as stored, if in a format the compact kernels read: one weight (copied,
    its rows in HF's order), or each expert's of a stacked tensor of experts (`names` theirs),
    mapped from the file as llama.cpp maps its weights: a Qwen3-30B-A3B's experts are 17 of
    its 18 GB at Q4_K_M, and copying them would hold them twice while loading (the mapped file
    and the copy) on a machine that holds them about once."""
    compact_format = tensor.tensor_type.name.lower()
    stacked = len(tensor.shape) == 3
    if compact_format not in FORMATS or len(tensor.shape) not in (2, 3):
        return None
    in_features, out_features = (int(n) for n in tensor.shape[:2])
    if in_features % FORMATS[compact_format].block:
        return None
    if stacked:
        # Its own mapping (copy-on-write, never written: the file's pages, shared with the page
        # cache), so that the file's other tensors are unmapped after loading.
        shape = (len(names), out_features, tensor.data.nbytes // len(names) // out_features)
        experts = np.memmap(gguf_file, np.uint8, "c", tensor.offset, shape)
        return [
            CompactWeight(compact_format, torch.from_numpy(rows), in_features) for rows in experts
        ]
    rows = _unpermute(np.asarray(tensor.data).reshape(out_features, -1), names[0], config)
    data = torch.from_numpy(np.array(rows, dtype=np.uint8, order="C"))
    return [CompactWeight(compact_format, data, in_features)]


def _unpermute(rows: np.ndarray, hf_name: str, config: ModelConfig) -> np.ndarray:
    """A tensor's rows in HF's order: llama.cpp's converter interleaved a llama's q and k rows
    (weights and biases) for its RoPE; every other tensor is stored in HF's order."""
    if config.architecture not in LLAMA_CPP_PERMUTED:
        return rows
    heads = permuted_heads(hf_name, config.num_heads, config.num_kv_heads)
    return unpermute_rows(rows, heads) if heads else rows
