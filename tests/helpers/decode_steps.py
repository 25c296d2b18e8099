"""A wrapper around the engine's native decode step that counts the batches it ran."""

from __future__ import annotations


class CountingStep:
    """Wraps the engine's decode step, counting the batches it ran."""

    def __init__(self, step) -> None:
        self.step, self.batches = step, 0

    def handles(self, q_lens) -> bool:
        return self.step.handles(q_lens)

    def __call__(self, *args):
        self.batches += 1
        return self.step(*args)
