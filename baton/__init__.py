"""Baton: a small, fast LLM serving engine.

`LLM` and `RequestOutput` are imported lazily so that processes which only need the wire types
(the HTTP frontend, the tokenizer) do not pay for importing the engine.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from baton.sampling_params import SamplingParams

# Settings of the libraries under the engine that Baton makes unless the user made them (a value
# the user sets wins). Both are read once, when torch loads or first allocates, so they are set
# here, before anything of Baton imports torch (a program that imported torch first keeps its
# own), and every server process inherits them.
ENVIRONMENT_DEFAULTS = {
    # The engine's native step and torch's OpenMP threads share the same cores. By default
    # libgomp's idle threads spin for a while after each torch op (a sampler's, a prefill's),
    # taking those cores from the native decode step that comes next: a sampled decode step ran
    # twice as long as a greedy one. Passive threads sleep at once.
    "OMP_WAIT_POLICY": "PASSIVE",
    # torch backs each allocation of 2 MB or more with transparent huge pages. A prefill's wide
    # intermediates (an MLP's gate/up rows: 40 MB for 1024 tokens of the 0.5B shape) are freed
    # and allocated again layer after layer, and each time the kernel faulted in 4 KB pages:
    # casting one such bf16 GEMM output to float32 took 61 ms, 3 ms on huge pages (AMX Xeon VM).
    "THP_MEM_ALLOC_ENABLE": "1",
}
# The settings that are Baton's, not the user's: benchmark peers start without them
# (bench/peers.py), as they would beside no Baton (llama.cpp's OpenMP threads lose a third of
# their speed when they must sleep between its barriers).
DEFAULTED_ENVIRONMENT = frozenset(name for name in ENVIRONMENT_DEFAULTS if name not in os.environ)
for _name, _value in ENVIRONMENT_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

if TYPE_CHECKING:
    from baton.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name in ("LLM", "RequestOutput"):
        from baton import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'baton' has no attribute {name!r}")
