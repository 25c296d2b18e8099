"""From a ForwardBatch to the sampler and back: which batches need no sampler at all, the
sampled rows' histories and suppressed tokens, and the logprobs in ForwardOutput's layout."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from baton.engine.forward_batch import PLACEHOLDER_TOKEN, ForwardBatch, TokenHistory
from baton.engine.sampler import SampleOutput


def plain_greedy(batch: ForwardBatch) -> bool:
    """Every sampled row takes the argmax of its raw logits and wants no logprobs."""
    return (
        all(p.is_greedy and p.logprobs is None for p in batch.sampling_params)
        and not any(batch.suppressed_token_ids)
        and not any(batch.histories)
    )


def completed_histories(batch: ForwardBatch, input_ids: list[int]) -> list[TokenHistory | None]:
    """Each sampled row's history with the tokens its placeholders stood for appended: outputs
    still being computed when the scheduler took its copy (overlap loop)."""
    starts = [0, *itertools.accumulate(batch.q_lens)]
    completed: list[TokenHistory | None] = []
    for row, history in zip(batch.sample_rows, batch.histories):
        if history is not None:
            resolved = [
                input_ids[index]
                for index in range(starts[row], starts[row + 1])
                if batch.input_ids[index] == PLACEHOLDER_TOKEN
            ]
            history = TokenHistory(history.tokens + resolved, history.prompt_len)
        completed.append(history)
    return completed


def suppress(logits: torch.Tensor, suppressed_token_ids: list[list[int]]) -> None:
    """Make the listed tokens of each sampled row impossible to sample (min_tokens)."""
    rows = [row for row, ids in enumerate(suppressed_token_ids) for _ in ids]
    if rows:
        columns = [token for ids in suppressed_token_ids for token in ids]
        logits[rows, columns] = float("-inf")


def logprob_lists(
    sampled: SampleOutput, num_logprobs: Sequence[int | None]
) -> tuple[list | None, list | None]:
    """Host-side logprobs, top-n trimmed to what each row asked for: per row, a list of one
    (ForwardOutput's layout: one entry per token the row yields)."""
    if sampled.logprobs is None:
        return None, None
    chosen = [[value] for value in sampled.logprobs.cpu().tolist()]
    if sampled.top_logprob_ids is None:
        return chosen, [[[]] for _ in chosen]
    ids = sampled.top_logprob_ids.cpu().tolist()
    values = sampled.top_logprobs.cpu().tolist()
    top = [
        [list(zip(row_ids[: n or 0], row_values[: n or 0]))]
        for row_ids, row_values, n in zip(ids, values, num_logprobs)
    ]
    return chosen, top
