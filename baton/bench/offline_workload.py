"""The offline benchmark's workload (seeded random prompts, exact output lengths) and what one
engine's timed run over it reports."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Workload:
    """The requests: prompt token ids and the exact number of tokens each must generate."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class EngineResult:
    """One engine's timed run over a workload."""

    engine: str
    elapsed_s: float
    num_requests: int
    input_tokens: int
    output_tokens: int  # generated tokens that count: each request's own length
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_throughput(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, throughputs included."""
        return {
            **asdict(self),
            "output_throughput": self.output_throughput,
            "total_throughput": self.total_throughput,
            "requests_per_s": self.num_requests / self.elapsed_s,
        }


def sample_lengths(mean: int, range_ratio: float, count: int, rng: random.Random) -> list[int]:
    """`count` lengths uniform in [floor(mean*(1-r)), ceil(mean*(1+r))], never below 1."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def make_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
) -> Workload:
    """Seeded random prompts (ids uniform over the model's vocabulary) and output lengths."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    input_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in input_lens]
    return Workload(prompts, output_lens)


def warmup_workload(vocab_size: int) -> Workload:
    """Untimed: enough to run prefill, decode and sampling once (seeded apart from the run)."""
    return make_workload(2, 16, 4, 0, vocab_size, seed=-1)
