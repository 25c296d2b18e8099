"""Shared test helpers: tiny checkpoint builders and transformers reference outputs.

Their names are imported on first use (PEP 562): a rank process spawned by a distributed test
unpickles its work from a module under `helpers`, and importing transformers there for nothing
cost each rank about 3 s of start-up.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "assert_greedy_matches_hf": "hf_reference",
    "hf_greedy_generate": "hf_reference",
    "hf_logits": "hf_reference",
    "load_hf_model": "hf_reference",
    "SAMPLE_CPU": "machines",
    "SAMPLE_PLAN": "machines",
    "SAMPLE_STATS": "machines",
    "free_port": "ports",
    "free_port_pair": "ports",
    "BOS_ID": "tiny_models",
    "CORE_VARIANTS": "tiny_models",
    "EOS_ID": "tiny_models",
    "EXTRA_EOS_ID": "tiny_models",
    "LONGROPE_FACTORS": "tiny_models",
    "PAD_ID": "tiny_models",
    "TINY_VARIANTS": "tiny_models",
    "VOCAB_SIZE": "tiny_models",
    "tiny_hf_model": "tiny_models",
    "write_tiny_checkpoint": "tiny_models",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'helpers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"helpers.{home}"), name)
