"""Verification of speculative-decoding drafts, one request row at a time, exact in distribution.

A row proposes m draft tokens d_0..d_{m-1}; one target forward pass scores the 1+m positions
(after the context, after d_0, ..., after d_{m-1}), giving target distributions p_0..p_m.

`accept_matching` keeps the drafts that equal the token the target chooses at their position,
then takes the target's own token at the first mismatch (or after the last draft). For greedy
rows the choice is the argmax: exactly greedy decoding. For sampled rows with deterministic
drafts (n-gram prompt lookup: q_i one-hot on d_i) the choice is the plain sampler's draw from
p_i, one uniform per position: d_i is then kept with probability p_i(d_i), and the token that
comes out at position i is a draw from p_i, so the output is distributed as p. This is the
standard rule for one-hot q (accept with probability p_i(d_i), else draw from p_i with d_i
removed) coupled to the sampler's own draw: the row's tokens are the ones it would sample
without speculation from the same uniforms.

Sampled drafts (a draft model, `verify_sampled`) use speculative sampling (Leviathan et al.
2023; Chen et al. 2023; vLLM's rejection sampler). Draft d_i, drawn from the draft distribution
q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection a token is
drawn from the residual max(0, p_i - q_i), normalised, and the row stops; if all m are accepted
a bonus token is drawn from p_m. Why the output is distributed as p_i: token x comes out of
position i either as an accepted draft, with probability q(x) * min(1, p(x)/q(x)) = min(p(x),
q(x)), or by rejection then residual, with probability (1 - sum_y min(p(y), q(y))) * max(0, p(x)
- q(x)) / Z, where Z = sum_y max(0, p(y) - q(y)) = 1 - sum_y min(p(y), q(y)); the sum is
min(p, q) + max(0, p - q) = p(x).

`target_probs` builds the p_i rows: the distribution `baton.engine.sampling.sampler.Sampler` draws
from for the request's `SamplingParams`, so speculation never changes what a request samples.
"""

from __future__ import annotations

import torch

from baton.engine.batch.seeded_uniforms import SeededUniforms, uniforms
from baton.engine.sampling.sampler import _draw
from baton.sampling_params import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] float32 logits -> [n, V] float32 probabilities of the distribution that
    baton.engine.sampling.sampler.Sampler draws from for `params` (temperature, then top-k, then
    min-p, then top-p over what min-p kept, always keeping the top token), row by row.

    Greedy params raise ValueError (verify those rows with `accept_matching`). NaN logits give
    NaN rows, which `verify_sampled` rejects.
    """
    if params.is_greedy:
        raise ValueError("greedy params have no sampling distribution: use accept_matching")
    temperature = torch.tensor(params.temperature, dtype=logits.dtype, device=logits.device)
    if params.top_k <= 0 and params.top_p >= 1.0:
        # Vocabulary order, as the sampler's "plain" strategy: min-p needs only the maximum.
        probs = torch.softmax(logits / temperature, dim=-1)
        if params.min_p > 0.0:
            probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        return probs / probs.sum(dim=-1, keepdim=True)
    if params.top_k > 0:
        # Top-k on raw logits (temperature keeps the order), softmax over the kept tokens only.
        values, ids = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1)
        probs = torch.softmax(values / temperature, dim=-1)
    else:
        probs, ids = torch.softmax(logits / temperature, dim=-1).sort(dim=-1, descending=True)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs[:, :1], 0.0)
    if params.top_p < 1.0:
        # A token stays while the mass strictly before it is below top_p of what min-p kept;
        # the first always stays.
        total = probs.sum(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= params.top_p * total, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(logits).scatter_(1, ids, probs)


def accept_matching(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """target_tokens: the token the target chooses at each of the 1+m verified positions (its
    argmax, or the plain sampler's draw); drafts: m tokens. Returns the accepted drafts (the
    longest prefix of drafts equal to target_tokens) followed by the bonus token (target_tokens
    at the first mismatch, or the last one if all accepted)."""
    if len(target_tokens) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target tokens")
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_tokens[accepted]:
        accepted += 1
    return [*drafts[:accepted], target_tokens[accepted]]


def keep_matching_draws(
    draws: list[int], drafts: list[int], generator: SeededUniforms | None
) -> list[int]:
    """A sampled row's deterministic drafts (n-gram: a one-hot q) against `draws`, the plain
    sampler's token at each of the 1+m positions, one uniform each from `generator`: the drafts
    kept while the draws match them, then the first draw that does not (`accept_matching`).
    The uniforms of the positions past it go back to the stream, so the request reads one per
    token it emits, as without speculation. (None: torch's default generator, not rewound.)"""
    emitted = accept_matching(draws, drafts)
    if generator is not None and len(draws) > len(emitted):
        generator.give_back(len(draws) - len(emitted))
    return emitted


def verify_sampled(
    probs: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: SeededUniforms | None,
) -> list[int]:
    """probs: [1+m, V] target probabilities (target_probs output) at the verified positions;
    draft_probs: [m, V] the draft model's probabilities the drafts were drawn from. Standard
    speculative sampling: accept draft i with probability min(1, p_i(d)/q_i(d)); at the first
    rejection draw from the normalised residual max(0, p_i - q_i) and stop; if all m are
    accepted draw the bonus from p_m. Returns accepted drafts + the one extra token. Random
    numbers from `generator` (None: torch's default).

    Draws m uniforms (one per draft) then one more for the extra token. A residual with no mass
    (p == q up to rounding) falls back to p. NaN probabilities raise ValueError.
    """
    m, vocab = len(drafts), probs.shape[-1]
    if probs.dim() != 2 or probs.shape[0] != m + 1:
        raise ValueError(f"{m} drafts need [{m + 1}, V] target probs, got {list(probs.shape)}")
    if draft_probs.shape != (m, vocab):
        raise ValueError(f"draft probs must be [{m}, {vocab}], got {list(draft_probs.shape)}")
    if drafts and not 0 <= min(drafts) <= max(drafts) < vocab:
        raise ValueError(f"draft tokens must be in [0, {vocab})")
    if bool(probs.isnan().any()) or bool(draft_probs.isnan().any()):
        raise ValueError("NaN probabilities")
    accepted = m
    if m:
        ids = torch.tensor(drafts, dtype=torch.int64, device=probs.device).unsqueeze(1)
        p = probs[:m].gather(1, ids).squeeze(1)
        q = draft_probs.gather(1, ids).squeeze(1)
        uniform = uniforms(generator, (m,), probs.device)
        # u < p/q without dividing: q(d) = 0 (a draft q never proposes) accepts iff p(d) > 0,
        # and p(d) = 0 (a token the filters removed) is never accepted.
        keep = uniform * q < p
        accepted = next((i for i, kept in enumerate(keep.tolist()) if not kept), m)
    weights = probs[accepted]
    if accepted < m:
        residual = (weights - draft_probs[accepted]).clamp_min(0.0)
        weights = torch.where(residual.sum() > 0, residual, weights)
    token = int(_draw(weights.unsqueeze(0), generator)[0])
    if token >= vocab:  # unreachable after the NaN check, unless probs held no mass at all
        raise ValueError("target probabilities hold no mass")
    return [*drafts[:accepted], token]
