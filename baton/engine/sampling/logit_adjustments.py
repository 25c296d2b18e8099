"""Penalties, logit bias, allowed tokens and bad words: what a request's own tokens and its
`logit_bias`, `allowed_token_ids` and `bad_words` do to its logits before its next token is
chosen, as vLLM does it.

In vLLM's order: the bias is added; each token seen in the prompt or the output has its logit
divided by `repetition_penalty` where positive, multiplied where not (transformers'
RepetitionPenaltyLogitsProcessor); then each token's logit loses `frequency_penalty` per time it
occurs in the output and `presence_penalty` once if it occurs at all. Then the tokens a request
may not sample become impossible: all but its `allowed_token_ids`, and the last token of each
bad word whose other tokens end the output so far (a one-token word, always). Greedy rows take
the argmax of the adjusted logits; log-probabilities stay those of the raw logits (vLLM's
default `raw_logprobs`).

Only the tokens concerned are touched (a row's distinct seen tokens, its bias entries), never a
whole vocabulary-wide row: at a 152k vocabulary a dense pass costs milliseconds a row.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.checkpoint.tokenizer import Tokenizer
from baton.engine.batch.forward_batch import TokenHistory
from baton.engine.sampling.token_counts import TokenCounts
from baton.sampling_params import SamplingParams

# Distinct lists of bad words whose token sequences are kept.
CACHED_BAD_WORD_LISTS = 64


class BadWordTokens:
    """Bad words as the token sequences that spell them, as vLLM reads them: each word as it
    stands (at the text's start) and after a space (inside the text), where that spelling
    starts with another token and is as long; computed once per list of words. A spelling with
    a token the model cannot sample (an added token past its logits' `vocab_size`) can never be
    generated, so it is left out: banning it would index past the logits."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.sequences = functools.lru_cache(maxsize=CACHED_BAD_WORD_LISTS)(self._sequences)

    def _sequences(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        sequences: list[tuple[int, ...]] = []
        for word in words:
            alone = self._encode(word.lstrip())
            spaced = self._encode(" " + word.lstrip())
            sequences.append(alone)
            if spaced and (not alone or spaced[0] != alone[0]) and len(spaced) == len(alone):
                sequences.append(spaced)
        return tuple(
            sequence
            for sequence in sequences
            if sequence and all(token < self._vocab_size for token in sequence)
        )

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))


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
    allowed_ids: torch.Tensor | None  # [a] int64: the only tokens it may sample
    banned_ids: torch.Tensor | None  # [n] int64: bad words' tokens it may not sample now


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
        bad_words: BadWordTokens | None = None,
        token_counts: Sequence[TokenCounts | None] | None = None,
        suppressed: Sequence[list[int]] | None = None,
    ) -> LogitAdjustments | None:
        """The adjustments of the rows that have a history (those whose params adjust their
        logits) or `suppressed` tokens (min_tokens' stop tokens, banned as bad words are);
        None when no row has any. `bad_words` spells the rows' bad words. A row that penalizes
        reads its `token_counts` entry (token_counts.py), counted from its history where it
        has none."""
        rows = tuple(
            _row_adjustment(
                row,
                params[row],
                history,
                token_counts[row] if token_counts else None,
                suppressed[row] if suppressed else [],
                device,
                bad_words,
            )
            for row, history in enumerate(histories or [None] * len(params))
            if history is not None or (suppressed and suppressed[row])
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
            if adjustment.allowed_ids is not None:
                allowed = row.index_select(0, adjustment.allowed_ids)
                row.fill_(float("-inf"))
                row.index_copy_(0, adjustment.allowed_ids, allowed)
            if adjustment.banned_ids is not None:
                row.index_fill_(0, adjustment.banned_ids, float("-inf"))
        return logits


def _row_adjustment(
    row: int,
    params: SamplingParams,
    history: TokenHistory | None,
    counts: TokenCounts | None,
    suppressed: list[int],
    device: torch.device | str,
    bad_words: BadWordTokens | None,
) -> RowAdjustment:
    bias_ids = bias_values = seen_ids = output_ids = output_penalties = None
    allowed_ids = banned_ids = None
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64, device=device)
        bias_values = torch.tensor(
            list(params.logit_bias.values()), dtype=torch.float32, device=device
        )
    if history is not None and params.penalizes:
        counts = counts if counts is not None else TokenCounts.of(history)
        ids = _int64_tensor(counts.ids, device)
        if params.repetition_penalty != 1.0:
            seen_ids = ids
        if (params.frequency_penalty or params.presence_penalty) and counts.has_output:
            output_counts = _int64_tensor(counts.output_counts, device)
            in_output = output_counts > 0
            output_ids = ids[in_output]
            output_penalties = (
                params.frequency_penalty * output_counts[in_output].float()
                + params.presence_penalty
            )
    if params.allowed_token_ids is not None:
        allowed_ids = torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=device)
    banned = list(suppressed)
    if history is not None and params.bad_words and bad_words is not None:
        banned += banned_tokens(bad_words.sequences(tuple(params.bad_words)), history)
    if banned:
        banned_ids = torch.tensor(banned, dtype=torch.int64, device=device)
    return RowAdjustment(
        row,
        bias_ids,
        bias_values,
        params.repetition_penalty,
        seen_ids,
        output_ids,
        output_penalties,
        allowed_ids,
        banned_ids,
    )


def _int64_tensor(values: array, device: torch.device | str) -> torch.Tensor:
    """A copy of an int32 array (never empty: a row's counts hold its prompt's tokens)."""
    return torch.frombuffer(values, dtype=torch.int32).to(device=device, dtype=torch.int64)


def banned_tokens(sequences: Sequence[tuple[int, ...]], history: TokenHistory) -> list[int]:
    """The last token of each bad word's sequence whose other tokens end the row's output: what
    the row may not sample now."""
    output = history.tokens[history.prompt_len :]
    banned = []
    for sequence in sequences:
        prefix = len(sequence) - 1
        if prefix == 0 or (len(output) >= prefix and tuple(output[-prefix:]) == sequence[:-1]):
            banned.append(sequence[-1])
    return banned
