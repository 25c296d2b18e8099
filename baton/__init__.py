"""Baton: a small, fast LLM serving engine.

`LLM` and `RequestOutput` are imported lazily so that processes which only need the wire types
(the HTTP frontend, the tokenizer) do not pay for importing the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name in ("LLM", "RequestOutput"):
        from baton import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'baton' has no attribute {name!r}")
