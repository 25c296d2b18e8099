"""From a ForwardBatch to the torch sampler and back: the sampled rows' histories, the logprobs
in ForwardOutput's layout, and the scored prompt tokens' logprobs."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from baton.engine.batch.forward_batch import (
    PLACEHOLDER_TOKEN,
    ForwardBatch,
    PromptScoring,
    TokenHistory,
)
from baton.engine.sampling.sampler import SampleOutput

# Scored prompt positions whose logits exist at a time: bounds a scoring step's memory (a chunk
# of 2048 prompt tokens over a 152k vocabulary would be 1.2 GB of logits, twice with softmax).
SCORING_SLICE_ROWS = 256


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


def scored_positions(batch: ForwardBatch, row_starts: Sequence[int]) -> list[int]:
    """The flat token indices whose logits score the batch's prompt tokens, in
    `prompt_scoring` order; `row_starts[row]` is the row's first flat index."""
    return [
        row_starts[scoring.row] + scoring.offset + k
        for scoring in batch.prompt_scoring
        for k in range(len(scoring.targets))
    ]


def prompt_logprobs(
    scored_logits: Callable[[int, int], torch.Tensor], scorings: list[PromptScoring]
) -> list[list[tuple[float, list[tuple[int, float]], int]]]:
    """Per scoring, each target's log-probability, the top-n (id, logprob) there and the
    target's rank (the tokens at least as likely, itself included: vLLM's count);
    `scored_logits(start, end)` gives the float32 logits of the scored positions [start, end),
    numbered over all `scorings` in order; it is asked for a slice at a time."""
    targets = torch.tensor([token for scoring in scorings for token in scoring.targets])
    num_scored = len(targets)
    max_top = max(scoring.num_top for scoring in scorings)
    chosen: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    for start in range(0, num_scored, SCORING_SLICE_ROWS):
        end = min(start + SCORING_SLICE_ROWS, num_scored)
        part = torch.log_softmax(scored_logits(start, end), dim=-1)
        rows_targets = targets[start:end].to(part.device).unsqueeze(1)
        chosen_part = part.gather(1, rows_targets)
        chosen.extend(chosen_part.squeeze(1).tolist())
        ranks.extend((part >= chosen_part).sum(dim=-1).clamp(min=1).tolist())
        if max_top:
            values, ids = part.topk(max_top, dim=-1)
            top_ids.extend(ids.tolist())
            top_values.extend(values.tolist())
    scored: list[list[tuple[float, list[tuple[int, float]], int]]] = []
    index = 0
    for scoring in scorings:
        entries = []
        for _ in scoring.targets:
            n = scoring.num_top
            top = list(zip(top_ids[index][:n], top_values[index][:n])) if n else []
            entries.append((chosen[index], top, ranks[index]))
            index += 1
        scored.append(entries)
    return scored
