"""What the penalties read of a sampled row's tokens: its distinct tokens so far and how often
each occurs in its output, kept per slot and extended by the tokens each step adds.

Rebuilding them from the row's whole history each step cost O(context) (a torch `unique` over
2048 tokens, every step); kept here, a step counts its one new token. The torch sampler
(logit_adjustments.py) and the native one (native/sampling/sampling.c) read the same counts.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from baton.engine.batch.forward_batch import ForwardBatch, TokenHistory


class TokenCounts:
    """One request's distinct tokens, prompt and output, in the order first seen, and each
    one's count in the output: int32 arrays the native sampler reads in place."""

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.length = 0  # tokens counted so far
        self.ids = array("i")
        self.output_counts = array("i")  # per entry of `ids`
        self._position: dict[int, int] = {}

    @classmethod
    def of(cls, history: TokenHistory) -> TokenCounts:
        counts = cls(history.prompt_len)
        counts.extend(history.tokens)
        return counts

    def extend(self, tokens: Sequence[int]) -> None:
        """Count `tokens[self.length:]`: `tokens` are the row's tokens so far, of which the
        first `length` were counted before."""
        for index in range(self.length, len(tokens)):
            token = tokens[index]
            position = self._position.get(token)
            if position is None:
                position = self._position[token] = len(self.ids)
                self.ids.append(token)
                self.output_counts.append(0)
            if index >= self.prompt_len:
                self.output_counts[position] += 1
        self.length = len(tokens)

    @property
    def has_output(self) -> bool:
        return self.length > self.prompt_len


class SlotTokenCounts:
    """The counts of each slot's request, for the rows whose params penalize.

    A slot's counts belong to the request that holds the slot: they start over on its first
    step there (`ForwardBatch.entered_slot`: a new request, or a preempted one readmitted), and
    within its tenure its tokens only grow, so each step counts only those added since."""

    def __init__(self) -> None:
        self._by_slot: dict[int, TokenCounts] = {}

    def update(
        self, batch: ForwardBatch, histories: Sequence[TokenHistory | None] | None
    ) -> list[TokenCounts | None] | None:
        """Per sampled row, its counts up to the token it samples now (None for a row that
        does not penalize); None when no row does. `histories` are the rows' completed ones."""
        if any(batch.entered_slot):
            for slot, entered in zip(batch.slots, batch.entered_slot):
                if entered:
                    self._by_slot.pop(slot, None)
        if histories is None:
            return None
        rows: list[TokenCounts | None] = []
        for row, params, history in zip(batch.sample_rows, batch.sampling_params, histories):
            if history is None or not params.penalizes:
                rows.append(None)
                continue
            slot = batch.slots[row]
            counts = self._by_slot.get(slot)
            if counts is None:
                counts = self._by_slot[slot] = TokenCounts(history.prompt_len)
            counts.extend(history.tokens)
            rows.append(counts)
        return rows if any(counts is not None for counts in rows) else None
