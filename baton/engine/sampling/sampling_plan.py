"""How one batch is sampled, planned once per batch: its greedy rows, its sampled rows grouped by
strategy and random source with their parameters gathered into tensors, its logprob requests
and its logit adjustments (what `Sampler.sample`, sampler.py, reads); and each request's own
random source."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from baton.engine.batch.forward_batch import TokenHistory
from baton.engine.batch.seeded_uniforms import SeededUniforms
from baton.engine.sampling.logit_adjustments import BadWordTokens, LogitAdjustments
from baton.engine.sampling.token_counts import TokenCounts
from baton.sampling_params import SamplingParams

# How a group of sampled rows finds its candidate tokens: a per-row top-k prefix, a nucleus search
# over the whole vocabulary, or the plain vocabulary-order distribution (no sort at all).
Strategy = Literal["top_k", "nucleus", "plain"]


@dataclass(frozen=True)
class RowGroup:
    """Sampled rows sharing one strategy and one random source, with their params pre-gathered."""

    rows: torch.Tensor | None  # [n] int64 batch indices; None = the whole batch, in order
    strategy: Strategy
    temperatures: torch.Tensor  # [n, 1] float32
    top_k: torch.Tensor  # [n] int64
    top_p: torch.Tensor  # [n] float32; disabled rows hold +inf so rounding can never cut them
    min_p: torch.Tensor  # [n] float32
    max_top_k: int
    needs_top_k_mask: bool  # some row keeps fewer than max_top_k tokens
    needs_top_p: bool
    needs_min_p: bool
    generator: SeededUniforms | None


@dataclass(frozen=True)
class SamplingBatch:
    """How one batch is sampled, planned once per batch: the greedy rows, the sampled rows'
    groups (each with its parameters gathered), and the logprob requests. Only what `sample`
    reads is built: this runs every step."""

    num_logprobs: tuple[int | None, ...]
    all_greedy: bool
    # [G] int64 indices of the greedy rows of a mixed batch; None when all or none are greedy.
    greedy_rows: torch.Tensor | None
    groups: tuple[RowGroup, ...]  # sampled rows: one group per seeded row, <= 3 unseeded groups
    logprob_rows: torch.Tensor | None  # [L] int64 rows asking for logprobs; None = every row
    max_num_logprobs: int  # n_max over rows asking; -1 when no row asks
    adjustments: LogitAdjustments | None = None  # penalties and biases, for rows that have any

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[SeededUniforms | None],
        device: torch.device | str,
        histories: Sequence[TokenHistory | None] = (),
        bad_words: BadWordTokens | None = None,
        token_counts: Sequence[TokenCounts | None] | None = None,
        suppressed: Sequence[list[int]] | None = None,
    ) -> SamplingBatch:
        """Gather per-row tensors and plan which rows are sampled together and how; a row
        whose params adjust its logits comes with its history (None for the others), and
        `bad_words`, `token_counts` and `suppressed` are `LogitAdjustments.build`'s."""
        if len(params) != len(generators):
            raise ValueError(f"{len(params)} params but {len(generators)} generators")
        greedy = [p.is_greedy for p in params]
        sampled = [i for i, is_greedy in enumerate(greedy) if not is_greedy]
        # Seeded rows are sampled alone so their tokens never depend on their batch neighbours.
        seeded = [i for i in sampled if generators[i] is not None]
        unseeded_by_strategy: dict[Strategy, list[int]] = {"top_k": [], "nucleus": [], "plain": []}
        for i in sampled:
            if generators[i] is None:
                unseeded_by_strategy[_strategy(params[i])].append(i)
        groups = [_make_group([i], params, generators[i], device, len(params)) for i in seeded]
        for rows in unseeded_by_strategy.values():
            if rows:
                groups.append(_make_group(rows, params, None, device, len(params)))
        asking = [i for i, p in enumerate(params) if p.logprobs is not None]
        return cls(
            num_logprobs=tuple(p.logprobs for p in params),
            all_greedy=not sampled,
            greedy_rows=torch.tensor(
                [i for i, g in enumerate(greedy) if g], dtype=torch.int64, device=device
            )
            if sampled and len(sampled) < len(params)
            else None,
            groups=tuple(groups),
            logprob_rows=None
            if len(asking) == len(params)
            else torch.tensor(asking, dtype=torch.int64, device=device),
            max_num_logprobs=max((params[i].logprobs or 0 for i in asking), default=-1),
            adjustments=LogitAdjustments.build(
                params, histories, device, bad_words, token_counts, suppressed
            ),
        )


def _strategy(params: SamplingParams) -> Strategy:
    """The cheapest way to find a sampled row's candidate tokens."""
    if params.top_k > 0:
        return "top_k"
    return "nucleus" if params.top_p < 1.0 else "plain"


def _make_group(
    rows: list[int],
    params: Sequence[SamplingParams],
    generator: SeededUniforms | None,
    device: torch.device | str,
    batch_size: int,
) -> RowGroup:
    """Pre-gather one group's params so sampling does no per-step host work."""
    chosen = [params[i] for i in rows]
    top_k = [max(p.top_k, 0) for p in chosen]
    return RowGroup(
        rows=None
        if rows == list(range(batch_size))
        else torch.tensor(rows, dtype=torch.int64, device=device),
        strategy=_strategy(chosen[0]),
        temperatures=torch.tensor(
            [[p.temperature] for p in chosen], dtype=torch.float32, device=device
        ),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(
            [p.top_p if p.top_p < 1.0 else float("inf") for p in chosen],
            dtype=torch.float32,
            device=device,
        ),
        min_p=torch.tensor([p.min_p for p in chosen], dtype=torch.float32, device=device),
        max_top_k=max(top_k),
        needs_top_k_mask=min(top_k) < max(top_k),
        needs_top_p=any(p.top_p < 1.0 for p in chosen),
        needs_min_p=any(p.min_p > 0.0 for p in chosen),
        generator=generator,
    )
