"""A checkpoint's tensors, read lazily one at a time: safetensors files, a GGUF file, or the
built-in random model's seeded weights. The one place the engine reads weights from disk."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from safetensors import safe_open

from baton.checkpoint.load import Checkpoint
from baton.checkpoint.model_config import CheckpointError
from baton.checkpoint.source import safetensors_files
from baton.engine.native.formats import CompactWeight
from baton.engine.native.library import NativeKernels
from baton.engine.weights.fused_tensors import unfused
from baton.engine.weights.gguf_weights import (
    iter_gguf_compact_weights,
    iter_gguf_weights,
)
from baton.engine.weights.random_weights import iter_random_weights

_COMPACT_SAFETENSORS_DTYPES = ("BF16", "F16")


def iter_weights(
    checkpoint: Checkpoint,
    native: NativeKernels | None = None,
    skip: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its HF parameter name, read lazily one at a time (a GGUF's blocks
    dequantized by the `native` kernels where given; those named in `skip`, which the model
    holds as stored, not read)."""
    if checkpoint.path is None:
        yield from iter_random_weights(checkpoint.config)
        return
    if checkpoint.gguf_file is not None:
        yield from iter_gguf_weights(checkpoint.gguf_file, checkpoint.config, native, skip)
        return
    yield from unfused(checkpoint.config, _safetensors(checkpoint, skip))


def _safetensors(
    checkpoint: Checkpoint, skip: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(checkpoint.path):
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as error:  # safetensors raises its own error types for bad files
            raise CheckpointError(f"{file}: unreadable safetensors: {error}") from error
        with handle as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in skip:
                    yield name, tensors.get_tensor(name)


def iter_compact_weights(checkpoint: Checkpoint) -> Iterator[tuple[str, CompactWeight]]:
    """The matrices stored more compactly than float32 (bf16, f16, GGUF blocks), as stored,
    under their HF names (see native/formats.py). Call after `iter_weights` has loaded the
    model: the files were checked then."""
    if checkpoint.path is None:
        return  # the random model is float32
    if checkpoint.gguf_file is not None:
        yield from iter_gguf_compact_weights(checkpoint.gguf_file, checkpoint.config)
        return
    yield from unfused(checkpoint.config, _compact_safetensors(checkpoint))


def _compact_safetensors(checkpoint: Checkpoint) -> Iterator[tuple[str, CompactWeight]]:
    for file in safetensors_files(checkpoint.path):
        with safe_open(str(file), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                if tensors.get_slice(name).get_dtype() in _COMPACT_SAFETENSORS_DTYPES:
                    compact = CompactWeight.from_tensor(tensors.get_tensor(name))
                    if compact is not None:
                        yield name, compact
