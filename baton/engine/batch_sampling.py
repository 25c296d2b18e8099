"""From a ForwardBatch to the sampler and back: which batches need no sampler at all, the
sampled rows' histories and suppressed tokens, the logprobs in ForwardOutput's layout, and the
scored prompt tokens' logprobs."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import torch

from baton.engine.forward_batch import (
    PLACEHOLDER_TOKEN,
    ForwardBatch,
    PromptScoring,
    TokenHistory,
)
from baton.engine.native.library import RowSampling
from baton.engine.sampler import SampleOutput
from baton.engine.token_counts import TokenCounts

# Scored prompt positions whose logits exist at a time: bounds a scoring step's memory (a chunk
# of 2048 prompt tokens over a 152k vocabulary would be 1.2 GB of logits, twice with softmax).
SCORING_SLICE_ROWS = 256


# A row the native step takes the argmax of.
GREEDY_ROW = RowSampling(0.0, 1.0, 0.0, 0.0, 0)


def sampled_in_native_step(batch: ForwardBatch) -> bool:
    """Whether the native step can choose every sampled row's token from its logits: no row
    wants logprobs, has its logits adjusted other than by penalties, suppressed or constrained,
    and no prompt is scored (greedy rows take the argmax; others are sampled as the torch
    sampler samples, each after its penalties)."""
    return (
        not batch.prompt_scoring
        and all(p.logprobs is None for p in batch.sampling_params)
        and not any(batch.suppressed_token_ids)
        and all(
            history is None or not (p.logit_bias or p.allowed_token_ids is not None or p.bad_words)
            for p, history in zip(batch.sampling_params, batch.histories)
        )
        and not any(batch.grammars)
    )


def row_sampling(
    batch: ForwardBatch,
    unseeded: random.Random,
    token_counts: Sequence[TokenCounts | None] | None = None,
) -> list[RowSampling] | None:
    """How the native step chooses each batch row's token (None: every row takes its raw
    argmax); a row that samples nothing (a prefill chunk's) takes the argmax, which is never
    read. A seeded row draws its uniform from its own generator, as the torch sampler does
    (one draw a step), so its tokens do not depend on the path or the batch; the others draw
    from `unseeded`, a Python generator, since a torch op here waits to retake the GIL. A
    penalizing row's `token_counts` entry (per sampled row) gives its penalties' tokens; the
    settings point into its arrays, which the caller keeps alive through the step."""
    params = batch.sampling_params
    if all(p.is_greedy for p in params) and not token_counts:
        return None
    settings = [GREEDY_ROW] * batch.num_rows
    for index, (row, p, generator) in enumerate(
        zip(batch.sample_rows, params, batch.generators, strict=True)
    ):
        counts = token_counts[index] if token_counts else None
        if p.is_greedy and counts is None:
            continue
        setting = RowSampling(0.0, 1.0, 0.0, 0.0, 0)
        if not p.is_greedy:
            if generator is None:
                uniform = unseeded.random()
            else:
                uniform = float(torch.rand(1, generator=generator))
            setting = RowSampling(p.temperature, p.top_p, p.min_p, uniform, p.top_k)
        if counts is not None:
            setting.repetition_penalty = p.repetition_penalty
            setting.frequency_penalty = p.frequency_penalty
            setting.presence_penalty = p.presence_penalty
            setting.num_seen = len(counts.ids)
            setting.seen_ids = counts.ids.buffer_info()[0]
            setting.output_counts = counts.output_counts.buffer_info()[0]
        settings[row] = setting
    return settings


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
