"""Baton: a small, fast LLM serving engine.

`LLM` and `RequestOutput` are imported lazily so that processes which only need the wire types
(the HTTP frontend, the tokenizer) do not pay for importing the engine.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from baton.sampling_params import SamplingParams

# The engine's native step and torch's OpenMP threads share the same cores. By default libgomp's
# idle threads spin for a while after each torch op (a sampler's, a prefill's), taking those
# cores from the native decode step that comes next: a sampled decode step ran twice as long as
# a greedy one. Passive threads sleep at once; a value the user sets wins. libgomp reads it when
# torch loads it, so it is set here, before anything of Baton imports torch (a program that
# imported torch first keeps its own setting), and every server process inherits it.
# OMP_WAIT_POLICY_DEFAULTED says the setting is Baton's, not the user's: benchmark peers start
# without it (bench/peers.py), as they would beside no Baton (llama.cpp's OpenMP threads lose a
# third of their speed when they must sleep between its barriers).
OMP_WAIT_POLICY_DEFAULTED = "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from baton.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name in ("LLM", "RequestOutput"):
        from baton import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'baton' has no attribute {name!r}")
