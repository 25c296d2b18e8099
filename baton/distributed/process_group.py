"""Joining the tensor-parallel ranks (torch.distributed over TCP), and the host messages rank 0
broadcasts to the others."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from baton.distributed.errors import DistributedError
from baton.distributed.tensor_parallel import TensorParallel


def join_tensor_parallel(
    rank: int, size: int, init_address: str, timeout_s: float, device: str
) -> TensorParallel:
    """Join `size` ranks at `init_address` (HOST:PORT, rank 0 listening): the device group on
    gloo (CPU) or NCCL (CUDA), and a gloo group of its own for host messages. DistributedError
    if the others have not all joined within `timeout_s` seconds."""
    if size == 1:
        return TensorParallel()
    on_cuda = torch.device(device).type == "cuda"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(
            "nccl" if on_cuda else "gloo",
            init_method=f"tcp://{init_address}",
            world_size=size,
            rank=rank,
            timeout=timeout,
        )
        group = dist.group.WORLD
        # A group of its own even on a CPU, where both are gloo: the scheduler thread broadcasts
        # host messages while the engine thread's step all-reduces (the overlap loop), and two
        # threads' collectives on one group could pair up differently on each rank.
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    except (RuntimeError, ValueError) as error:  # torch's DistStoreError is a RuntimeError
        raise DistributedError(
            f"rank {rank} of {size} could not join the others at {init_address} within "
            f"{timeout_s:g} s (--distributed-timeout-seconds): {_first_line(error)}"
        ) from None
    return TensorParallel(rank=rank, size=size, group=group, cpu_group=cpu_group)


def leave(tp: TensorParallel) -> None:
    """Leave the group (a no-op for a single process)."""
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def broadcast_bytes(tp: TensorParallel, payload: bytes | None) -> bytes:
    """Rank 0's `payload` on every rank (the others pass None): its length, then its bytes,
    over the gloo group. DistributedError if a rank is gone."""
    try:
        length = torch.tensor([len(payload) if tp.is_first else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=tp.cpu_group)
        size = int(length.item())
        if tp.is_first:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if size else None
        else:
            data = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.broadcast(data, src=0, group=tp.cpu_group)
    except RuntimeError as error:
        raise DistributedError(
            f"rank {tp.rank}: a broadcast failed: {_first_line(error)}"
        ) from None
    if tp.is_first:
        return payload
    return data.numpy().tobytes() if size else b""


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
