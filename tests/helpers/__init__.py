"""Shared test helpers: tiny checkpoint builders and transformers reference outputs."""

from helpers.hf_reference import (
    assert_greedy_matches_hf,
    hf_greedy_generate,
    hf_logits,
    load_hf_model,
)
from helpers.machines import SAMPLE_CPU, SAMPLE_PLAN, SAMPLE_STATS
from helpers.ports import free_port, free_port_pair
from helpers.tiny_models import (
    BOS_ID,
    EOS_ID,
    EXTRA_EOS_ID,
    PAD_ID,
    TINY_VARIANTS,
    VOCAB_SIZE,
    tiny_hf_model,
    write_tiny_checkpoint,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "EXTRA_EOS_ID",
    "PAD_ID",
    "SAMPLE_CPU",
    "SAMPLE_PLAN",
    "SAMPLE_STATS",
    "TINY_VARIANTS",
    "VOCAB_SIZE",
    "assert_greedy_matches_hf",
    "free_port",
    "free_port_pair",
    "hf_greedy_generate",
    "hf_logits",
    "load_hf_model",
    "tiny_hf_model",
    "write_tiny_checkpoint",
]
