"""Checkpoint resolution: a local HF folder, a Hugging Face hub id, or the built-in default model.

Loading validates everything but the tensors themselves up front (config, tokenizer, which
safetensors files exist), so a bad checkpoint fails with a `CheckpointError` naming the file
before any memory is spent; `iter_weights` then streams the tensors one at a time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from baton.engine.default_model import (
    DEFAULT_MODEL_NAME,
    default_model_config,
    default_tokenizer,
    iter_default_weights,
)
from baton.engine.model_config import CheckpointError, ModelConfig, token_id_tuple
from baton.tokenizer_proc.tokenizer import load_tokenizer

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint"]

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# What a hub download fetches: enough to serve, never other weight formats.
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    SAFETENSORS_INDEX_FILE,
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
]


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A resolved model: its architecture, tokenizer, stop tokens and where its weights live."""

    name: str  # served model name: folder name, hub id or "baton-default"
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, merged
    path: Path | None  # None for the built-in default model

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor under its HF parameter name, read lazily one at a time."""
        if self.path is None:
            yield from iter_default_weights(self.config)
            return
        for file in _safetensors_files(self.path):
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as error:  # safetensors raises its own error types for bad files
                raise CheckpointError(f"{file}: unreadable safetensors: {error}") from error
            with handle as tensors:
                for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, tensors.get_tensor(name)


def load_checkpoint(model: str | None) -> Checkpoint:
    """Resolve `model`: None -> the default model; an existing folder; otherwise a hub id."""
    if model is None:
        config = default_model_config()
        tokenizer = default_tokenizer()
        return Checkpoint(DEFAULT_MODEL_NAME, config, tokenizer, config.eos_token_ids, None)
    path, name = _checkpoint_folder(model)
    return _load_folder(path, name)


def load_model_config(model: str | None) -> ModelConfig:
    """Just the architecture of `model`, resolved as `load_checkpoint` resolves it (a hub id is
    downloaded), without loading its tokenizer."""
    if model is None:
        return default_model_config()
    path, _ = _checkpoint_folder(model)
    return ModelConfig.from_hf(_read_json(path / "config.json", required=True))


def _checkpoint_folder(model: str) -> tuple[Path, str]:
    """The folder `model` names (a hub id is downloaded) and the name it is served under."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path, path.resolve().name
    if path.exists() or model.startswith(("/", ".", "~")):
        raise CheckpointError(f"{model}: not a checkpoint folder")
    return _download(model), model


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    logger.info("no local folder %r: fetching it from the Hugging Face hub", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as error:  # network, auth, unknown repo, invalid id: all mean "cannot load"
        raise CheckpointError(
            f"{repo_id}: no such local folder, and the hub download failed: {error}"
        ) from error


def _load_folder(path: Path, name: str) -> Checkpoint:
    config = ModelConfig.from_hf(_read_json(path / "config.json", required=True))
    _safetensors_files(path)  # fail now, not when the engine starts loading weights
    if not any((path / file).is_file() for file in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = load_tokenizer(path)
    except Exception as error:  # transformers raises many types for a broken tokenizer
        raise CheckpointError(f"{path}: cannot load the tokenizer: {error}") from error
    generation = _read_json(path / "generation_config.json", required=False)
    eos_ids = _merge_eos(
        config.eos_token_ids, token_id_tuple(generation.get("eos_token_id")), tokenizer
    )
    logger.info("checkpoint %s: %s, %d layers", name, config.architecture, config.num_layers)
    return Checkpoint(name, config, tokenizer, eos_ids, path)


def _merge_eos(
    from_config: tuple[int, ...],
    from_generation: tuple[int, ...],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[int, ...]:
    """Ordered union of both files' stop tokens; the tokenizer's EOS only if neither names one."""
    merged = tuple(dict.fromkeys(from_config + from_generation))
    if not merged and tokenizer.eos_token_id is not None:
        merged = (tokenizer.eos_token_id,)
    return merged


def _read_json(file: Path, required: bool) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise CheckpointError(f"{file}: missing")
        return {}
    try:
        content = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: unreadable: {error}") from error
    if not isinstance(content, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return content


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files: the shards an index lists, or the single `model.safetensors`."""
    index = path / SAFETENSORS_INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        files = [path / shard for shard in sorted(set(weight_map.values()))]
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists missing shard(s) {', '.join(missing)}")
        return files
    single = path / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE}")
