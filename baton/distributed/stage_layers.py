"""Which layers each pipeline stage holds: a pure function of the model's shape, so the launcher
refuses an impossible split in one line before it starts any process (and imports no torch)."""

from __future__ import annotations

import itertools


def stage_layers(num_layers: int, size: int, head_layers: float = 0.0) -> list[range]:
    """Every stage's layers: contiguous runs that balance the stages' work, where the last
    stage's LM head counts as `head_layers` layers (its weights over one layer's: a Llama 3
    head of 128k rows is about four of its layers), as evenly as whole layers allow.
    ValueError when some stage would hold none."""
    if num_layers < size:
        raise ValueError(f"{num_layers} layers cannot make --pipeline-parallel-size {size} stages")
    total = num_layers + head_layers
    # Stage s ends where s + 1 shares of the total work end, each stage keeping one layer at
    # least and leaving one to each stage after it.
    ends = []
    for stage in range(1, size):
        end = int(stage * total / size + 0.5)  # (halves up: the last stage has the head)
        end = max(end, (ends[-1] if ends else 0) + 1)
        ends.append(min(end, num_layers - (size - stage)))
    bounds = [0, *ends, num_layers]
    return [range(start, stop) for start, stop in itertools.pairwise(bounds)]
