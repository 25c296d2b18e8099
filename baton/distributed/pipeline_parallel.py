"""A rank's place among pipeline stages, and what passes between them.

Each stage holds a contiguous run of the model's layers (the first the embedding, the last the
final norm and the LM head), the runs sized so that every stage has about as much to compute. A
micro-batch's hidden states go from a stage's rank to the same tensor-parallel rank of the next
stage, point to point on the device group (gloo on CPU, NCCL on CUDA); the last stage's sampled
tokens go back to every rank of the replica over a gloo group of their own, so every rank's
scheduler applies the same outputs (Vajra's replicated sequence managers). Size 1 is a single
stage: it holds every layer and sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from baton.distributed.errors import DistributedError
from baton.distributed.host_broadcast import broadcast_bytes, first_line


@dataclass(frozen=True)
class PipelineParallel:
    """This rank's `stage` of `size`; the global ranks of the previous and next stage's rank
    it exchanges hidden states with (over `group`), and the rank whose outputs every rank takes
    (`output_source`, over the gloo `output_group`)."""

    stage: int = 0
    size: int = 1
    previous_rank: int | None = None
    next_rank: int | None = None
    group: Any = None
    output_source: int = 0
    output_group: Any = None
    rank: int = 0  # this process's global rank

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.size:
            raise ValueError(f"stage {self.stage} outside a pipeline of {self.size}")

    @property
    def is_first(self) -> bool:
        """Whether this stage embeds the tokens."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage computes the logits and samples."""
        return self.stage == self.size - 1

    def send_hidden(self, hidden: torch.Tensor) -> dist.Work:
        """Start sending a micro-batch's hidden states to the next stage; the caller keeps
        `hidden` alive and waits on the returned work before it sends again."""
        try:
            return dist.isend(hidden.contiguous(), self.next_rank, group=self.group)
        except RuntimeError as error:
            raise DistributedError(
                f"stage {self.stage}: a send failed: {first_line(error)}"
            ) from None

    def receive_hidden(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The previous stage's hidden states of the micro-batch it sent next."""
        hidden = torch.empty(shape, dtype=dtype, device=device)
        try:
            dist.recv(hidden, self.previous_rank, group=self.group)
        except RuntimeError as error:
            raise DistributedError(
                f"stage {self.stage}: the previous stage is gone: {first_line(error)}"
            ) from None
        return hidden

    def share_outputs(self, payload: bytes | None) -> bytes:
        """The output source's `payload` (its encoded micro-batch outputs) on every rank; the
        others pass None. Every rank calls it once per micro-batch, in launch order."""
        return broadcast_bytes(self.output_group, self.output_source, self.rank, payload)
