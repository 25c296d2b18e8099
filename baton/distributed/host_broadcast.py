"""Bytes from one rank to every other over a gloo group: rank 0's host messages each scheduler
iteration, the last pipeline stage's outputs each micro-batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from baton.distributed.errors import DistributedError


def broadcast_bytes(group: Any, source: int, rank: int, payload: bytes | None) -> bytes:
    """`source`'s `payload` on every rank of `group` (the others pass None; `rank` is this
    process's global rank): its length, then its bytes. DistributedError if a rank is gone."""
    sending = rank == source
    try:
        length = torch.tensor([len(payload) if sending else 0], dtype=torch.int64)
        dist.broadcast(length, src=source, group=group)
        size = int(length.item())
        if sending:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if size else None
        else:
            data = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.broadcast(data, src=source, group=group)
    except RuntimeError as error:
        raise DistributedError(f"rank {rank}: a broadcast failed: {first_line(error)}") from None
    if sending:
        return payload
    return data.numpy().tobytes() if size else b""


def first_line(error: BaseException) -> str:
    """An error's first line (torch's collective errors run to many)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
