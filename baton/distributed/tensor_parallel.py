"""A rank's place in its tensor-parallel group, and the collectives its model layers call.

Megatron-style sharding (engine/models): column-parallel layers (q/k/v, gate/up, the vocabulary
of the embedding and the LM head) hold a contiguous share of their output features, row-parallel
ones (o, down) the matching share of their input features, whose partial products `all_reduce`
sums. Size 1 is a single process: every collective returns its input untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among `size` tensor-parallel ranks and their device group (gloo on
    CPU, NCCL on CUDA; None for a single process)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a group of {self.size}")

    def share(self, total: int, what: str) -> tuple[int, int]:
        """This rank's contiguous share of `total` items (heads, features, vocabulary rows):
        (start, count). ValueError naming `what` unless the ranks divide it evenly."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) do not divide evenly over --tensor-parallel-size {self.size}"
            )
        count = total // self.size
        return self.rank * count, count

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the ranks, in place; returned."""
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's [rows, n] in rank order, side by side: [rows, size * n]."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
