"""Penalties and logit bias: what a request's own tokens and its `logit_bias` do to its logits
before its next token is chosen, as vLLM does it.

In vLLM's order: the bias is added; each token seen in the prompt or the output has its logit
divided by `repetition_penalty` where positive, multiplied where not (transformers'
RepetitionPenaltyLogitsProcessor); then each token's logit loses `frequency_penalty` per time it
occurs in the output and `presence_penalty` once if it occurs at all. Greedy rows take the argmax
of the adjusted logits; log-probabilities stay those of the raw logits (vLLM's default
`raw_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.engine.forward_batch import TokenHistory
from baton.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitAdjustments:
    """One batch's adjustments, gathered once per step for the rows that have any."""

    rows: torch.Tensor  # [n] int64: which rows of the batch's logits are adjusted
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token id, value)
    repetition: torch.Tensor | None  # [n, 1] float32; with `seen`, the tokens it applies to
    seen: torch.Tensor | None  # [n, V] bool: in the prompt or the output
    frequency: torch.Tensor | None  # [n, 1] float32
    presence: torch.Tensor | None  # [n, 1] float32
    output_counts: torch.Tensor | None  # [n, V] float32: occurrences in the output

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> LogitAdjustments | None:
        """The adjustments of the rows whose params ask for any (None when none does); such a
        row has a history."""
        rows = [i for i, p in enumerate(params) if p.adjusts_logits]
        if not rows:
            return None
        chosen = [params[i] for i in rows]
        row_histories = [histories[i] for i in rows] if len(histories) == len(params) else []
        if len(row_histories) != len(rows) or None in row_histories:
            raise ValueError("a row with penalties or a logit bias came without its history")
        bias_entries = [
            (index, token_id, value)
            for index, p in enumerate(chosen)
            for token_id, value in (p.logit_bias or {}).items()
        ]
        bias = None
        if bias_entries:
            row_ids, token_ids, values = zip(*bias_entries)
            bias = (
                torch.tensor(row_ids, dtype=torch.int64, device=device),
                torch.tensor(token_ids, dtype=torch.int64, device=device),
                torch.tensor(values, dtype=torch.float32, device=device),
            )
        repetition = seen = frequency = presence = output_counts = None
        if any(p.repetition_penalty != 1.0 for p in chosen):
            repetition = _column([p.repetition_penalty for p in chosen], device)
            seen = _token_matrix([h.tokens for h in row_histories if h], vocab_size, device).bool()
        if any(p.frequency_penalty or p.presence_penalty for p in chosen):
            frequency = _column([p.frequency_penalty for p in chosen], device)
            presence = _column([p.presence_penalty for p in chosen], device)
            output_counts = _token_matrix(
                [h.tokens[h.prompt_len :] for h in row_histories if h],
                vocab_size,
                device,
            )
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64, device=device),
            bias=bias,
            repetition=repetition,
            seen=seen,
            frequency=frequency,
            presence=presence,
            output_counts=output_counts,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Adjusted copy of `logits` [B, V] (float32), which are left unmodified."""
        scores = logits.index_select(0, self.rows)
        if self.bias is not None:
            scores.index_put_(self.bias[:2], self.bias[2], accumulate=True)
        if self.repetition is not None:
            penalized = torch.where(scores > 0, scores / self.repetition, scores * self.repetition)
            scores = torch.where(self.seen, penalized, scores)
        if self.output_counts is not None:
            scores -= self.frequency * self.output_counts
            scores -= self.presence * (self.output_counts > 0)
        return logits.clone().index_copy_(0, self.rows, scores)


def _column(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def _token_matrix(
    token_lists: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[n, V] float32: how many times each token occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    for row, tokens in enumerate(token_lists):
        if tokens:
            ids = torch.tensor(tokens, dtype=torch.int64, device=device)
            counts[row].index_add_(0, ids, torch.ones(len(tokens), device=device))
    return counts
