"""Ranks joining over gloo, rank 0's bytes broadcast to the others, and a rank that never
comes: one line naming the timeout."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed_ranks import run_ranks

from baton.distributed.process_group import Ranks
from baton.distributed.tensor_parallel import TensorParallel

PAYLOADS = [b"", b"\x00\xffmsgpack", bytes(range(256)) * 1000]


def broadcast_payloads(ranks: Ranks) -> list[bytes]:
    return [ranks.broadcast(payload if ranks.is_first else None) for payload in PAYLOADS]


def sum_and_gather(ranks: Ranks) -> tuple[list[float], list[list[float]]]:
    tp = ranks.tp
    summed = tp.all_reduce(torch.full((3,), float(tp.rank + 1)))
    gathered = tp.all_gather_columns(torch.full((2, 2), float(tp.rank)))
    return summed.tolist(), gathered.tolist()


def test_every_rank_receives_rank_0s_bytes_empty_and_large_alike() -> None:
    results = run_ranks(broadcast_payloads)
    assert results == {0: ("ok", PAYLOADS), 1: ("ok", PAYLOADS)}


def test_partial_sums_add_up_and_columns_gather_in_rank_order() -> None:
    expected = ([3.0, 3.0, 3.0], [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    assert run_ranks(sum_and_gather) == {0: ("ok", expected), 1: ("ok", expected)}


def test_a_rank_that_never_joins_is_one_line_after_the_timeout() -> None:
    (status, message) = run_ranks(broadcast_payloads, size=2, timeout_s=2.0, ranks=(0,))[0]
    assert status == "error"
    first = message.splitlines()[0]
    assert first.startswith("DistributedError: rank 0 of 2 could not join the others at 127.0.0.1:")
    assert "within 2 s (--distributed-timeout-seconds)" in first


def test_one_rank_is_a_single_process_whose_collectives_change_nothing() -> None:
    tp = TensorParallel()
    assert tp.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
    assert tp.all_gather_columns(torch.ones(1, 2)).tolist() == [[1.0, 1.0]]
    assert tp.share(10, "heads") == (0, 10)


def test_a_share_the_ranks_cannot_divide_is_named() -> None:
    tp = TensorParallel(rank=1, size=2, group=None)
    assert tp.share(8, "KV heads") == (4, 4)
    with pytest.raises(ValueError) as refused:
        tp.share(9, "query heads")
    expected = "query heads (9) do not divide evenly over --tensor-parallel-size 2"
    assert str(refused.value) == expected
