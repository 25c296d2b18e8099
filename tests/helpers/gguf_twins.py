"""transformers' float32 reference for a GGUF file: an HF folder of the weights it holds."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save_file

from baton.checkpoint.gguf_metadata import converted_folder
from baton.checkpoint.load import load_checkpoint
from baton.engine.weights.checkpoint_tensors import iter_weights
from baton.engine.weights.fused_tensors import fused


def dequantized_twin(gguf_file: Path, target: Path) -> Path:
    """An HF folder holding the weights `gguf_file` holds, dequantized by the `gguf` package
    (each expert's under its HF name, a Gemma's norms and Phi-3's fused projections as their
    checkpoints store them), with the
    config and tokenizer converted from its metadata."""
    shutil.copytree(converted_folder(gguf_file), target)
    checkpoint = load_checkpoint(str(gguf_file))
    # (No native kernels: gguf's numpy; Phi-3's projections fused, as its checkpoints hold them.)
    weights = dict(fused(checkpoint.config, iter_weights(checkpoint)))
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
