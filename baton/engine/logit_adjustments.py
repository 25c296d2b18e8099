"""Penalties and logit bias: what a request's own tokens and its `logit_bias` do to its logits
before its next token is chosen, as vLLM does it.

In vLLM's order: the bias is added; each token seen in the prompt or the output has its logit
divided by `repetition_penalty` where positive, multiplied where not (transformers'
RepetitionPenaltyLogitsProcessor); then each token's logit loses `frequency_penalty` per time it
occurs in the output and `presence_penalty` once if it occurs at all. Greedy rows take the argmax
of the adjusted logits; log-probabilities stay those of the raw logits (vLLM's default
`raw_logprobs`).

Only the tokens concerned are touched (a row's distinct seen tokens, its bias entries), never a
whole vocabulary-wide row: at a 152k vocabulary a dense pass costs milliseconds a row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.engine.forward_batch import TokenHistory
from baton.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowAdjustment:
    """One row's adjustments, as index tensors over its vocabulary."""

    row: int
    bias_ids: torch.Tensor | None  # [b] int64, distinct
    bias_values: torch.Tensor | None  # [b] float32
    repetition_penalty: float
    seen_ids: torch.Tensor | None  # [s] int64: distinct tokens of the prompt and output
    output_ids: torch.Tensor | None  # [o] int64: distinct output tokens
    output_penalties: torch.Tensor | None  # [o] float32: frequency * count + presence


@dataclass(frozen=True)
class LogitAdjustments:
    """One batch's adjustments, gathered once per step for the rows that have any."""

    rows: tuple[RowAdjustment, ...]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory | None],
        device: torch.device | str,
    ) -> LogitAdjustments | None:
        """The adjustments of the rows that have a history: those whose params have
        penalties or a bias (None when no row has)."""
        rows = tuple(
            _row_adjustment(row, params[row], history, device)
            for row, history in enumerate(histories)
            if history is not None
        )
        return cls(rows) if rows else None

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjust `logits` [B, V] (float32) in place; returns them."""
        for adjustment in self.rows:
            row = logits[adjustment.row]
            if adjustment.bias_ids is not None:
                row.index_add_(0, adjustment.bias_ids, adjustment.bias_values)
            if adjustment.seen_ids is not None:
                seen = row.index_select(0, adjustment.seen_ids)
                penalty = adjustment.repetition_penalty
                row.index_copy_(
                    0, adjustment.seen_ids, torch.where(seen > 0, seen / penalty, seen * penalty)
                )
            if adjustment.output_ids is not None:
                row.index_add_(0, adjustment.output_ids, -adjustment.output_penalties)
        return logits


def _row_adjustment(
    row: int, params: SamplingParams, history: TokenHistory, device: torch.device | str
) -> RowAdjustment:
    bias_ids = bias_values = seen_ids = output_ids = output_penalties = None
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
        bias_values = torch.tensor(
            list(params.logit_bias.values()), dtype=torch.float32, device=device
        )
    tokens = torch.tensor(history.tokens, dtype=torch.int64, device=device)
    if params.repetition_penalty != 1.0:
        seen_ids = tokens.unique()
    if (params.frequency_penalty or params.presence_penalty) and len(tokens) > history.prompt_len:
        output_ids, counts = tokens[history.prompt_len :].unique(return_counts=True)
        output_penalties = params.frequency_penalty * counts.float() + params.presence_penalty
    return RowAdjustment(
        row,
        bias_ids,
        bias_values,
        params.repetition_penalty,
        seen_ids,
        output_ids,
        output_penalties,
    )
