"""A replica's ranks as processes for tests: each runs a function of this module after joining
the others over gloo, and puts what it found on a queue."""

from __future__ import annotations

import multiprocessing
import socket
import traceback
from collections.abc import Callable
from typing import Any

from baton.distributed.process_group import join_ranks, leave


def free_address() -> str:
    """A free TCP port on 127.0.0.1, as HOST:PORT."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _rank_main(
    work: Callable, rank: int, size: int, stages: int, address: str, timeout_s: float, queue
) -> None:
    try:
        ranks = join_ranks(rank, size // stages, stages, address, timeout_s, "cpu")
        try:
            queue.put((rank, "ok", work(ranks)))
        finally:
            leave(ranks)
    except BaseException as error:  # reported to the test, which raises it
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_ranks(
    work: Callable,
    size: int = 2,
    timeout_s: float = 60.0,
    ranks: tuple[int, ...] | None = None,
    stages: int = 1,
) -> dict[int, tuple[str, Any]]:
    """`work(ranks)` (a `Ranks`) on each of `ranks` (default: all `size`) of a replica of
    `stages` pipeline stages, in processes of their own; each rank's ("ok", result) or
    ("error", message)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    address = free_address()
    started = [
        context.Process(
            target=_rank_main, args=(work, rank, size, stages, address, timeout_s, queue)
        )
        for rank in (ranks if ranks is not None else range(size))
    ]
    for process in started:
        process.start()
    results = {}
    for _ in started:
        rank, status, value = queue.get(timeout=timeout_s + 120)
        results[rank] = (status, value)
    for process in started:
        process.join(timeout=30)
    return results
