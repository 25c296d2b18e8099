"""Tokenizer services without sockets, shared by the tokenizer process's test modules."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.tokenizer_frames import MAX_MODEL_LEN

from baton.checkpoint.load import Checkpoint
from baton.config import BatonConfig
from baton.tokenizer_proc.service import TokenizerService


@pytest.fixture(scope="module")
def service(random_checkpoint: Checkpoint) -> TokenizerService:
    """The default model's byte tokenizer with a short context, to reach the limits cheaply."""
    vocab = random_checkpoint.config.vocab_size
    return TokenizerService(random_checkpoint.tokenizer, vocab, MAX_MODEL_LEN, "fcfs")


@pytest.fixture(scope="module")
def stories_service(stories260k_dir: Path) -> TokenizerService:
    """A real trained tokenizer (SentencePiece-style BPE, BOS added, no chat template)."""
    return TokenizerService.from_config(BatonConfig(model=str(stories260k_dir)))
