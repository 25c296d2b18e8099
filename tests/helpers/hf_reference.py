"""Reference outputs from transformers itself, to compare Baton's model and engine against."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@lru_cache(maxsize=16)
def load_hf_model(model_dir: Path) -> PreTrainedModel:
    """The checkpoint as a float32 transformers model, cached per folder.

    Never modify it (no `.to(dtype)`): load a separate copy for other dtypes.
    """
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(token_ids), vocab] for one sequence."""
    model = load_hf_model(Path(model_dir))
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy_generate(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' float32 greedy continuation: exactly `max_new_tokens` tokens, EOS ignored.

    A plain argmax loop over transformers' own KV cache rather than `generate`, whose config
    merging re-adds the checkpoint's EOS. EOS is neither a stop nor suppressed: an engine run with
    ignore_eos may legitimately pick EOS as its greedy token, and so does this reference.
    """
    model = load_hf_model(Path(model_dir))
    new_tokens: list[int] = []
    with torch.no_grad():
        output = model(torch.tensor([prompt_ids]), use_cache=True)
        for step in range(max_new_tokens):
            token = int(output.logits[0, -1].argmax())
            new_tokens.append(token)
            if step + 1 < max_new_tokens:
                output = model(
                    torch.tensor([[token]]), past_key_values=output.past_key_values, use_cache=True
                )
    return new_tokens


def assert_greedy_matches_hf(
    model_dir: Path, prompt_ids: list[int], generated_ids: list[int], tolerance: float = 1e-3
) -> None:
    """Assert each generated token is transformers' greedy choice, given the tokens before it.

    Teacher-forced on `generated_ids`, so a near-tie (top-2 logits within `tolerance`, which
    float32 rounding may legitimately break either way) neither fails the check nor derails the
    steps after it. Any real bug moves logits by far more than `tolerance`.
    """
    logits = hf_logits(model_dir, prompt_ids + generated_ids[:-1])[len(prompt_ids) - 1 :]
    for step, (row, token) in enumerate(zip(logits, generated_ids, strict=True)):
        best = int(row.argmax())
        if token != best and float(row[best] - row[token]) > tolerance:
            raise AssertionError(
                f"step {step}: generated {token}, transformers prefers {best} by "
                f"{float(row[best] - row[token]):.3g} (generated so far {generated_ids[:step]})"
            )
