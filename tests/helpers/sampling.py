"""An independent reference for the sampler's filtered distribution."""

from __future__ import annotations

import torch

from baton.sampling_params import SamplingParams

# Distinct, shuffled logits so vocabulary order differs from probability order and no filter
# threshold in the cases below lies near a boundary.
SMALL_LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.0, 0.0, 1.5, -0.5, 0.6])
FILTER_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.65),
    SamplingParams(min_p=0.3),
    # min-p keeps 4 tokens, then top-p 3 of them; top-p first would keep 4.
    SamplingParams(top_p=0.85, min_p=0.2),
    SamplingParams(temperature=0.8, top_k=4, min_p=0.25),
]


def reference_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """vLLM's filtered distribution, computed independently in float64 with explicit loops:
    temperature, top-k, min-p, then top-p over what is left (vLLM's sampler's order)."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    kept = order[: params.top_k] if params.top_k > 0 else order
    top = max(probs[i].item() for i in kept)
    kept = [i for i in kept if probs[i].item() >= params.min_p * top]
    total = sum(probs[i].item() for i in kept)
    if params.top_p < 1.0:
        nucleus, mass_before = [], 0.0
        for i in kept:
            if mass_before < params.top_p:
                nucleus.append(i)
            mass_before += probs[i].item() / total
        kept = nucleus
    expected = torch.zeros_like(probs)
    for i in kept:
        expected[i] = probs[i]
    return expected / expected.sum()
