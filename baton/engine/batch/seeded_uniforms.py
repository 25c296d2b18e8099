"""A seeded request's own random numbers: uniforms in [0, 1) from its torch generator, drawn a
block at a time.

On CPU a block holds exactly the numbers that drawing one at a time would give (torch's CPU
generator fills a tensor's elements in order), so every path that samples the request (the
native step, the torch sampler, speculative verification) reads one stream, and its tokens do
not depend on the path or the batch. The native step reads the stream without a torch op: each
one on the engine thread gives up the GIL and waits to retake it (about 0.14 ms a step).
"""

from __future__ import annotations

import math

import torch

# Uniforms drawn at once: one torch op per this many of the request's tokens.
BLOCK = 64


class SeededUniforms:
    """One request's uniforms, from a generator seeded with its `seed`."""

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self._generator = torch.Generator(device=torch.device(device))
        self._generator.manual_seed(seed)
        self._block: list[float] = []
        self._next = 0  # the first unread entry of _block
        self._previous: list[float] = []  # the block before _block (for give_back)

    def take(self, count: int) -> list[float]:
        """The stream's next `count` uniforms."""
        values: list[float] = []
        while len(values) < count:
            if self._next == len(self._block):
                device = self._generator.device
                self._previous = self._block
                self._block = torch.rand(BLOCK, generator=self._generator, device=device).tolist()
                self._next = 0
            end = min(len(self._block), self._next + count - len(values))
            values += self._block[self._next : end]
            self._next = end
        return values

    def give_back(self, count: int) -> None:
        """Return the last `count` uniforms taken (at most a block's worth) to the stream: the
        next takes yield them again. Speculative verification draws a token for every verified
        position and gives back those past the first rejected draft, so a request reads one
        uniform per token it emits, however many drafts it verified."""
        if count <= self._next:
            self._next -= count
            return
        from_previous = count - self._next
        if from_previous > len(self._previous):
            raise ValueError(f"cannot give back {count} uniforms: more than were taken")
        self._block = self._previous[len(self._previous) - from_previous :] + self._block
        self._previous = self._previous[: len(self._previous) - from_previous]
        self._next = 0

    def rand(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """The next uniforms as a float32 tensor of `shape` (torch.rand's values, in order)."""
        values = self.take(math.prod(shape))
        return torch.tensor(values, dtype=torch.float32, device=device).view(shape)


def seeded_uniforms(seed: int | None, device: torch.device | str) -> SeededUniforms | None:
    """A request's own random source (created once per request), or None when it has no seed:
    it then draws from torch's default generator (the native step, from --seed's Python one)."""
    return None if seed is None else SeededUniforms(seed, device)


def uniforms(
    source: SeededUniforms | None, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """torch.rand(shape) from a request's own source, or torch's default generator."""
    if source is None:
        return torch.rand(shape, device=device)
    return source.rand(shape, device)
