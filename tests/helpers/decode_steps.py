"""A wrapper around the engine's native decode step that counts the batches it ran."""

from __future__ import annotations


class CountingStep:
    """Wraps the engine's decode step, counting the batches it ran and those whose tokens it
    chose itself (the rest returned logits for the torch sampler)."""

    def __init__(self, step) -> None:
        self.step, self.batches, self.chosen = step, 0, 0

    def handles(self, q_lens) -> bool:
        return self.step.handles(q_lens)

    def __call__(self, input_ids, kv_starts, page_tables, choose, sampling=None):
        self.batches += 1
        self.chosen += choose
        return self.step(input_ids, kv_starts, page_tables, choose, sampling)
