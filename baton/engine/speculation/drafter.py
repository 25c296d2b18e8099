"""Where drafts come from: one interface, and the n-gram drafter behind it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from baton.engine.batch.seeded_uniforms import SeededUniforms
from baton.engine.speculation.ngram import NgramProposer
from baton.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    """One speculative row: its slot, its sequence's tokens (the last one, at position
    len - 1, is the row's input whose K/V is not computed yet), how many drafts it may take, its
    pages (covering every draft position), sampling params and random source."""

    slot: int
    context: list[int]
    num_drafts: int
    page_table: list[int]
    params: SamplingParams
    generator: SeededUniforms | None


@dataclass(frozen=True)
class Draft:
    """Up to `num_drafts` tokens, and the draft distribution each was drawn from ([n, vocab];
    None when the drafts are deterministic, as n-gram lookups are)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes drafts for a batch's speculative rows, in order."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...

    def forget(self, slot: int) -> None:
        """A new request took the slot: nothing known of the previous one applies."""


class NgramDrafter:
    """Prompt lookup: no model, so any number of drafts (maybe none) per row."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.proposer = NgramProposer(num_speculative_tokens, min_n, max_n)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [
            Draft(self.proposer.propose(request.context, request.num_drafts))
            for request in requests
        ]

    def forget(self, slot: int) -> None:
        pass  # keeps nothing per slot
