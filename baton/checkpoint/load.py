"""A checkpoint as every server process but the frontend needs it: its config, tokenizer and
stop tokens (source.py says where its files are).

Loading validates everything but the tensors themselves up front (config, tokenizer, which
safetensors files exist), so a bad checkpoint fails with a `CheckpointError` naming the file
before any memory is spent; the engine then streams the tensors
(engine/weights/checkpoint_tensors.py). Nothing here imports torch: every server process resolves
the model, only the scheduler computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from baton.checkpoint.byte_tokenizer import build_byte_tokenizer
from baton.checkpoint.chat_template import read_chat_template
from baton.checkpoint.json_files import read_json
from baton.checkpoint.model_config import CheckpointError, ModelConfig, token_id_tuple
from baton.checkpoint.random_model import RANDOM_MODEL_NAME
from baton.checkpoint.source import resolve_model, safetensors_files
from baton.checkpoint.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "load_checkpoint"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A resolved model: its architecture, tokenizer, stop tokens and where its weights live."""

    name: str  # served model name: folder name, GGUF file stem, hub id or "baton-random"
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]  # config.json's and generation_config.json's, merged
    path: Path | None  # None for the built-in random model
    gguf_file: Path | None = None  # the weights of a GGUF checkpoint (`path` is its metadata)

    @property
    def stored_compactly(self) -> bool:
        """Its matrices take fewer bytes than float32: a GGUF, or a bf16/f16 checkpoint."""
        return self.gguf_file is not None or self.config.torch_dtype in ("bfloat16", "float16")


def load_checkpoint(model: str | None, chat_template: str | None = None) -> Checkpoint:
    """Resolve `model` (see `resolve_model`) and load its config and tokenizer; the weight
    files are checked to exist, not read. `chat_template`, `--chat-template`'s value (a template
    or its file), replaces the checkpoint's own (ValueError in one line if it cannot be used)."""
    source = resolve_model(model)
    config = source.load_config()
    if source.folder is None:
        tokenizer = build_byte_tokenizer()  # the random model's
        checkpoint = Checkpoint(RANDOM_MODEL_NAME, config, tokenizer, config.eos_token_ids, None)
    else:
        if source.gguf_file is None:
            safetensors_files(source.folder)  # fail now, not when the engine loads weights
        tokenizer = Tokenizer.from_folder(source.folder)
        generation = read_json(source.folder / "generation_config.json", required=False)
        eos_ids = _merge_eos(
            config.eos_token_ids, token_id_tuple(generation.get("eos_token_id")), tokenizer
        )
        logger.info(
            "checkpoint %s: %s, %d layers", source.name, config.architecture, config.num_layers
        )
        checkpoint = Checkpoint(
            source.name, config, tokenizer, eos_ids, source.folder, source.gguf_file
        )
    if chat_template is not None:
        tokenizer.use_chat_template(read_chat_template(chat_template))
    return checkpoint


def _merge_eos(
    from_config: tuple[int, ...],
    from_generation: tuple[int, ...],
    tokenizer: Tokenizer,
) -> tuple[int, ...]:
    """Ordered union of both files' stop tokens; the tokenizer's EOS only if neither names one."""
    merged = tuple(dict.fromkeys(from_config + from_generation))
    if not merged and tokenizer.eos_token_id is not None:
        merged = (tokenizer.eos_token_id,)
    return merged
