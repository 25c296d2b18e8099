"""Named model shapes with seeded random weights, written once as Hugging Face checkpoints.

A benchmark needs no trained weights, only the right shape; writing the random weights to disk in
Hugging Face format (config.json, model.safetensors, tokenizer, generation_config.json) lets every
engine (Baton, transformers, later vLLM or llama.cpp) load the very same model.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from baton.checkpoint.byte_tokenizer import (
    BOS_TOKEN,
    BYTE_SPECIAL_TOKENS,
    BYTE_VOCAB_SIZE,
    EOS_TOKEN,
    PAD_TOKEN,
    build_byte_tokenizer,
)

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path("~/.cache/baton/shapes")
# The weights are part of the shape, not of a run: every run and every engine sees the same ones.
WEIGHT_SEED = 0
# Written last, so a folder holding it is complete (an interrupted write never looks finished).
COMPLETE_MARKER = ".complete"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The byte-level tokenizer's special tokens, which the model configs name as BOS/EOS/PAD.
_SPECIAL_IDS = {token: BYTE_VOCAB_SIZE + offset for offset, token in enumerate(BYTE_SPECIAL_TOKENS)}
BOS_ID, EOS_ID, PAD_ID = _SPECIAL_IDS[BOS_TOKEN], _SPECIAL_IDS[EOS_TOKEN], _SPECIAL_IDS[PAD_TOKEN]


@dataclass(frozen=True)
class BenchWorkload:
    """The offline benchmark's default workload for a shape: about a minute or two on 2 cores."""

    num_prompts: int
    input_len: int
    output_len: int


@dataclass(frozen=True)
class ModelShape:
    """One Qwen2 architecture: `Qwen2Config` keyword arguments (no token ids), bench defaults."""

    name: str
    config_kwargs: dict[str, Any]
    bench_workload: BenchWorkload

    def hf_config(self, dtype: torch.dtype) -> Qwen2Config:
        """The transformers config, with the byte tokenizer's special token ids."""
        return Qwen2Config(
            **self.config_kwargs,
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            dtype=dtype,
        )


SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape(
            "tiny",
            {
                "hidden_size": 256,
                "intermediate_size": 1024,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 32000,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            },
            BenchWorkload(num_prompts=64, input_len=128, output_len=128),
        ),
        # Qwen2.5-0.5B's published config.json, minus the sliding-window fields it leaves off.
        ModelShape(
            "qwen2.5-0.5b",
            {
                "hidden_size": 896,
                "intermediate_size": 4864,
                "num_hidden_layers": 24,
                "num_attention_heads": 14,
                "num_key_value_heads": 2,
                "vocab_size": 151936,
                "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            },
            BenchWorkload(num_prompts=32, input_len=128, output_len=64),
        ),
    )
}


# Bumped whenever what a shape folder holds changes, so older cached folders are not reused.
# 2: the tokenizer spells every id of the model's vocabulary (filler words above the bytes).
SHAPE_FORMAT = 2


def shape_dir(name: str, cache_dir: Path, dtype: str) -> Path:
    """Where `materialize_shape` keeps shape `name` in `dtype`."""
    return cache_dir.expanduser() / f"{name}-{dtype}-v{SHAPE_FORMAT}"


def materialize_shape(name: str, cache_dir: Path, dtype: str) -> Path:
    """The checkpoint folder of shape `name` in `dtype`, written on first use, then reused."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose {', '.join(_DTYPES)}")
    target = shape_dir(name, cache_dir, dtype)
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("writing random-weight shape %s (%s) to %s", name, dtype, target)
    # Write beside the target, then rename: concurrent or interrupted runs never see half a folder.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_checkpoint(SHAPES[name], staging, _DTYPES[dtype])
        (staging / COMPLETE_MARKER).touch()
        staging.chmod(0o755)  # mkdtemp's 0o700 would hide the cache from other users
        if target.exists():
            shutil.rmtree(target)  # an incomplete leftover from an interrupted write
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_checkpoint(shape: ModelShape, directory: Path, dtype: torch.dtype) -> None:
    model = random_model(shape, dtype)
    model.save_pretrained(directory)
    build_byte_tokenizer(shape.config_kwargs["vocab_size"]).save(directory)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID).save_pretrained(
        directory
    )


def random_model(shape: ModelShape, dtype: torch.dtype) -> Qwen2ForCausalLM:
    """A `shape` model in `dtype` with seeded weights: N(0, initializer_range), norms 1, biases 0.

    Built on the meta device and filled in place, so no float32 copy and no transformers
    initialisation pass is ever paid for (both dominate building the 0.5B shape otherwise).
    """
    config = shape.hf_config(dtype)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to(dtype).to_empty(device="cpu").eval()
    # to_empty gives the tied lm_head its own tensor; re-tie so it is saved (and filled) once.
    model.tie_weights()
    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    with torch.no_grad():
        # named_parameters lists a tied lm_head once, under the embedding's name.
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    return model
