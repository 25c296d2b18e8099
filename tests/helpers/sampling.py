"""An independent reference for the sampler's filtered distribution."""

from __future__ import annotations

import torch

from baton.sampling_params import SamplingParams


def reference_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """vLLM's filtered distribution, computed independently in float64 with explicit loops."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    kept = order[: params.top_k] if params.top_k > 0 else order
    total = sum(probs[i].item() for i in kept)
    if params.top_p < 1.0:
        nucleus, mass_before = [], 0.0
        for i in kept:
            if mass_before < params.top_p:
                nucleus.append(i)
            mass_before += probs[i].item() / total
        kept = nucleus
    top = max(probs[i].item() for i in kept)
    kept = [i for i in kept if probs[i].item() >= params.min_p * top]
    expected = torch.zeros_like(probs)
    for i in kept:
        expected[i] = probs[i]
    return expected / expected.sum()
