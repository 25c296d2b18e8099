"""The greedy choice: a row's first maximum, fast on CPU."""

from __future__ import annotations

import torch

# Vocabulary blocks `greedy_argmax` may use, widest first: wide blocks mean few block maxima,
# and 256 measured fastest (32k and 152k vocabularies, 16 rows).
_ARGMAX_BLOCKS = (256, 128, 64)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (the first maximum on ties) of [B, V] logits, fast on CPU.

    torch's CPU argmax over a row does not vectorise (~0.3 ms for 16 x 32k, 1 ms for 16 x 152k)
    while amax does. So: block maxima by amax, the first block holding the row's maximum, then
    the first maximum inside that block; equal to argmax, ties included. 5x faster at 16 x 32k.
    """
    rows, vocab = logits.shape
    block = next((size for size in _ARGMAX_BLOCKS if vocab % size == 0), None)
    if logits.device.type != "cpu" or block is None:
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // block, block)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)
    row_index = torch.arange(rows, device=logits.device)
    within = blocks[row_index, best_block].argmax(dim=-1)
    return best_block * block + within
