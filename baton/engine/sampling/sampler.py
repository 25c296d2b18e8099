"""Per-request token sampling: greedy, temperature, top-k, top-p and min-p, optionally seeded.

Filters apply in vLLM's order: logits / temperature, then top-k, then min-p (tokens below min_p
times the top token's probability go), then top-p over what min-p kept (the nucleus, always
keeping the top token). Log-probabilities come from the raw (unscaled, unfiltered) distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.batch.seeded_uniforms import SeededUniforms, uniforms
from baton.engine.sampling.argmax import greedy_argmax
from baton.engine.sampling.sampling_plan import RowGroup, SamplingBatch


@dataclass(frozen=True)
class SampleOutput:
    """Chosen tokens and, for rows that asked, raw-distribution log-probabilities.

    Rows that did not ask hold NaN log-probabilities and -1 ids; a row asking for n < n_max top
    log-probabilities should read only its first n columns. A `failed` row (its distribution was
    not a distribution, e.g. NaN logits) holds token 0: its request must end with an error.
    """

    token_ids: torch.Tensor  # [B] int64
    failed: torch.Tensor  # [B] bool
    logprobs: torch.Tensor | None  # [B] float32 log-prob of the chosen token (None if no row asked)
    top_logprob_ids: torch.Tensor | None  # [B, n_max] int64
    top_logprobs: torch.Tensor | None  # [B, n_max] float32


class Sampler:
    """Turns a batch of logits into tokens according to each row's `SamplingParams`."""

    def __init__(self, nucleus_prefix: int = 1024) -> None:
        # On CPU a full-vocabulary sort dominates a top-p step (~180 ms at B=32, V=152k), while
        # the nucleus usually fits in the top few hundred tokens, so top-p first tries this prefix.
        self.nucleus_prefix = nucleus_prefix

    def sample(self, raw_logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """Pick one token per row of `raw_logits` ([B, V] float32) after the rows' penalties
        and biases, applied in place unless logprobs (the raw logits') are asked for."""
        logits = raw_logits
        if batch.adjustments is not None:
            adjusted = raw_logits.clone() if batch.max_num_logprobs >= 0 else raw_logits
            logits = batch.adjustments.apply_(adjusted)
        if batch.all_greedy:
            token_ids = greedy_argmax(logits)
        else:
            token_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            if batch.greedy_rows is not None:
                greedy_logits = logits.index_select(0, batch.greedy_rows)
                token_ids.index_copy_(0, batch.greedy_rows, greedy_argmax(greedy_logits))
            for group in batch.groups:
                if group.rows is None:
                    token_ids = self._sample_group(logits, group)
                else:
                    chosen = self._sample_group(logits.index_select(0, group.rows), group)
                    token_ids.index_copy_(0, group.rows, chosen)
        # NaN probabilities draw an id past the vocabulary: that row alone fails, and its id is
        # made valid so the batch's other rows (and their logprobs) go on.
        failed = (token_ids < 0) | (token_ids >= logits.shape[-1])
        token_ids.masked_fill_(failed, 0)
        return _with_logprobs(raw_logits, token_ids, failed, batch)

    def _sample_group(self, logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
        """Token ids [n] for a group's rows of logits [n, V]."""
        if group.strategy == "top_k":
            # Temperature never reorders tokens, so select on raw logits and scale only the prefix.
            values, ids = logits.topk(min(group.max_top_k, logits.shape[-1]), dim=-1)
            values = values / group.temperatures
            if group.needs_top_k_mask:
                positions = torch.arange(values.shape[-1], device=values.device)
                values = values.masked_fill(positions >= group.top_k.unsqueeze(1), float("-inf"))
            probs = _min_p(torch.softmax(values, dim=-1), group)
            return _sample_sorted(probs, ids, group, probs.sum(dim=-1, keepdim=True))
        probs = _min_p(torch.softmax(logits / group.temperatures, dim=-1), group)
        if group.strategy == "nucleus":
            return self._sample_nucleus(probs, group)
        return _draw(probs, group.generator)

    def _sample_nucleus(self, probs: torch.Tensor, group: RowGroup) -> torch.Tensor:
        """Top-p over the full vocabulary (what min-p kept of it), sorting only rows whose
        nucleus overflows the prefix."""
        total = probs.sum(dim=-1, keepdim=True)  # the mass top_p is a share of
        prefix = min(self.nucleus_prefix, probs.shape[-1])
        if probs.device.type != "cpu" or prefix == probs.shape[-1]:
            # Accelerators sort fast, and the coverage check below would force a host sync.
            return _sample_sorted(*probs.sort(dim=-1, descending=True), group, total)
        top_probs, top_ids = probs.topk(prefix, dim=-1)
        # Past the prefix every token's preceding mass is >= the prefix mass, so when that reaches
        # top_p the prefix holds the whole nucleus and sampling from it is exact.
        covered = top_probs.cumsum(dim=-1)[:, -1] >= group.top_p * total.squeeze(1)
        if bool(covered.all()):
            return _sample_sorted(top_probs, top_ids, group, total)
        if not bool(covered.any()):
            return _sample_sorted(*probs.sort(dim=-1, descending=True), group, total)
        token_ids = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        inside, overflow = covered.nonzero().squeeze(1), (~covered).nonzero().squeeze(1)
        prefix_ids = _sample_sorted(
            top_probs[inside], top_ids[inside], group, total[inside], inside
        )
        token_ids.index_copy_(0, inside, prefix_ids)
        sorted_probs, sorted_ids = probs[overflow].sort(dim=-1, descending=True)
        token_ids.index_copy_(
            0,
            overflow,
            _sample_sorted(sorted_probs, sorted_ids, group, total[overflow], overflow),
        )
        return token_ids


def _min_p(probs: torch.Tensor, group: RowGroup) -> torch.Tensor:
    """Zero the tokens below min_p times their row's largest probability (softmax keeps ratios,
    so this is the same on a top-k prefix as on the full vocabulary)."""
    if not group.needs_min_p:
        return probs
    threshold = group.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def _sample_sorted(
    probs: torch.Tensor,
    ids: torch.Tensor,
    group: RowGroup,
    total: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply top-p to descending `probs` [n, m] (min-p applied) and draw; `ids` maps back to
    tokens, and top_p is a share of `total` [n, 1], what min-p kept of each row's mass.

    `rows` picks which of the group's rows `probs` holds (None: all of them).
    """
    if group.needs_top_p:
        top_p = group.top_p if rows is None else group.top_p.index_select(0, rows)
        # A token stays while the mass strictly before it is below top_p; the first always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1) * total, 0.0)
    draws = _draw(probs, group.generator)
    # A draw past the candidates (NaN weights) maps to -1, which `Sampler.sample` reports failed.
    failed = draws >= ids.shape[1]
    chosen = ids.gather(1, draws.clamp(max=ids.shape[1] - 1).unsqueeze(1)).squeeze(1)
    return chosen.masked_fill_(failed, -1)


def _draw(weights: torch.Tensor, generator: SeededUniforms | None) -> torch.Tensor:
    """One index per row, with probability proportional to `weights` [n, m] (>= 0, unnormalised);
    m for a row whose weights are no distribution (NaN, or all zero).

    Inverse-CDF sampling needs one uniform per row; torch.multinomial and exponential races over a
    152k vocabulary cost ~100 ms per batch on CPU, this ~5 ms.
    """
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    uniform = uniforms(generator, tuple(total.shape), weights.device)
    target = uniform * total
    # Rounding can lift the target to the total, past the last nonzero weight; the first nonzero
    # weight is as valid a pick for that ~2**-24 event and keeps filtered tokens unreachable.
    target = torch.where(target < total, target, torch.zeros_like(target))
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # searchsorted over NaN may land anywhere: such rows are marked explicitly (NaN > 0 is False).
    return index.masked_fill_(~(total.squeeze(1) > 0), weights.shape[1])


def _with_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, failed: torch.Tensor, batch: SamplingBatch
) -> SampleOutput:
    """Attach raw-distribution log-probabilities for the rows that asked for them."""
    if batch.max_num_logprobs < 0:
        return SampleOutput(token_ids, failed, None, None, None)
    rows = batch.logprob_rows
    raw = logits if rows is None else logits.index_select(0, rows)
    chosen_ids = token_ids if rows is None else token_ids.index_select(0, rows)
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)
    if rows is None:
        return SampleOutput(token_ids, failed, chosen, top_ids, top_values)
    batch_size, n_max = logits.shape[0], batch.max_num_logprobs
    all_chosen = logits.new_full((batch_size,), float("nan")).index_copy_(0, rows, chosen)
    all_values = logits.new_full((batch_size, n_max), float("nan")).index_copy_(0, rows, top_values)
    all_ids = torch.full((batch_size, n_max), -1, dtype=torch.int64, device=logits.device)
    all_ids.index_copy_(0, rows, top_ids)
    return SampleOutput(token_ids, failed, all_chosen, all_ids, all_values)
