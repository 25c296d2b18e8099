"""transformers' float32 reference for a GGUF file: an HF folder of the weights it holds."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save_file

from baton.checkpoint.gguf_metadata import converted_folder
from baton.checkpoint.load import load_checkpoint
from baton.engine.weights.checkpoint_tensors import iter_weights


def dequantized_twin(gguf_file: Path, target: Path) -> Path:
    """An HF folder holding the weights `gguf_file` holds, dequantized by the `gguf` package
    (each expert's under its HF name, a Gemma's norms as its checkpoints store them), with the
    config and tokenizer converted from its metadata."""
    shutil.copytree(converted_folder(gguf_file), target)
    weights = dict(iter_weights(load_checkpoint(str(gguf_file))))  # (no native: gguf's numpy)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
