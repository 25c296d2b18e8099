"""Fixtures shared by the detokenizer tests."""

from __future__ import annotations

import pytest

from baton.checkpoint.load import Checkpoint
from baton.checkpoint.tokenizer import Tokenizer


@pytest.fixture
def tokenizer(random_checkpoint: Checkpoint) -> Tokenizer:
    """The default model's byte-level tokenizer: token b is byte b."""
    return random_checkpoint.tokenizer
