"""One model served on CUDA twice, decode graphs replayed and `--enforce-eager`, for the tests
that hold the two token for token (tests/cuda)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from baton import LLM, SamplingParams


def greedy_graphed_and_eager(
    model_dir: Path, prompts: list[list[int]], params: SamplingParams, **options: object
) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's tokens with decode graphs recorded (asserted), then eagerly; `options` go
    to both `LLM`s (bf16 on CUDA unless they say otherwise). Each engine is freed before the
    next starts, so the two never share the GPU's memory."""
    runs = []
    for eager in (False, True):
        llm = LLM(
            str(model_dir),
            **{"device": "cuda", "dtype": "bfloat16", "enforce_eager": eager, **options},
        )
        try:
            assert (llm.engine.decode_graphs is None) == eager
            runs.append([output.token_ids for output in llm.generate(prompts, params)])
        finally:
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    return runs[0], runs[1]
