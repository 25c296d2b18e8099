"""Joining a replica's ranks (torch.distributed over TCP): their groups, and the host messages
rank 0 broadcasts to the others."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from baton.distributed.errors import DistributedError
from baton.distributed.host_broadcast import broadcast_bytes, first_line
from baton.distributed.pipeline_parallel import PipelineParallel
from baton.distributed.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class Ranks:
    """This process's `rank` among its replica's `size` ranks, laid out stage after stage
    (rank = stage x tensor-parallel size + tensor-parallel rank, as vLLM lays them out): its
    tensor-parallel group (`tp`), its pipeline stage (`pp`), and a gloo group over every rank
    for the host messages rank 0 broadcasts. `Ranks()`: a single process."""

    rank: int = 0
    size: int = 1
    host_group: Any = None
    tp: TensorParallel = field(default_factory=TensorParallel)
    pp: PipelineParallel = field(default_factory=PipelineParallel)

    @property
    def is_first(self) -> bool:
        """Whether this rank talks to the rest of the server (ZMQ): rank 0."""
        return self.rank == 0

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank (the others pass None)."""
        return broadcast_bytes(self.host_group, 0, self.rank, payload)


def join_ranks(
    rank: int, tp_size: int, pp_size: int, init_address: str, timeout_s: float, device: str
) -> Ranks:
    """Join the replica's `tp_size` x `pp_size` ranks at `init_address` (HOST:PORT, rank 0
    listening): the device groups on gloo (CPU) or NCCL (CUDA), gloo groups for host messages
    and the last stage's outputs. DistributedError if the others have not all joined within
    `timeout_s` seconds."""
    size = tp_size * pp_size
    if size == 1:
        return Ranks()
    on_cuda = torch.device(device).type == "cuda"
    timeout = datetime.timedelta(seconds=timeout_s)
    stage, tp_rank = divmod(rank, tp_size)
    try:
        dist.init_process_group(
            "nccl" if on_cuda else "gloo",
            init_method=f"tcp://{init_address}",
            world_size=size,
            rank=rank,
            timeout=timeout,
        )
        # Groups of their own even on a CPU, where all are gloo: each is used by one thread
        # of every rank (host messages: the scheduler's; outputs: the engine's on the last
        # stage, a receiver's on the others; the device group: the engine's), and two threads'
        # collectives on one group could pair up differently on each rank.
        host_group = dist.new_group(backend="gloo", timeout=timeout)
        output_group = dist.new_group(backend="gloo", timeout=timeout) if pp_size > 1 else None
        tp_group = dist.group.WORLD if pp_size == 1 else None
        if pp_size > 1 and tp_size > 1:
            # new_group is collective: every rank creates every stage's group, in order.
            for each in range(pp_size):
                group = dist.new_group(
                    list(range(each * tp_size, (each + 1) * tp_size)), timeout=timeout
                )
                if each == stage:
                    tp_group = group
    except (RuntimeError, ValueError) as error:  # torch's DistStoreError is a RuntimeError
        raise DistributedError(
            f"rank {rank} of {size} could not join the others at {init_address} within "
            f"{timeout_s:g} s (--distributed-timeout-seconds): {first_line(error)}"
        ) from None
    tp = TensorParallel(rank=tp_rank, size=tp_size, group=tp_group)
    pp = PipelineParallel(
        stage=stage,
        size=pp_size,
        previous_rank=rank - tp_size if stage > 0 else None,
        next_rank=rank + tp_size if stage < pp_size - 1 else None,
        group=dist.group.WORLD,
        output_source=(pp_size - 1) * tp_size,
        output_group=output_group,
        rank=rank,
    )
    return Ranks(rank=rank, size=size, host_group=host_group, tp=tp, pp=pp)


def leave(ranks: Ranks) -> None:
    """Leave the groups (a no-op for a single process)."""
    if ranks.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
