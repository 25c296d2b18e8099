"""The batch sizes decode steps are captured at, and the bucket each batch is padded to."""

from __future__ import annotations

import pytest

from baton.engine.graphs.buckets import bucket_for, graph_batch_sizes


@pytest.mark.parametrize(
    ("max_batch_size", "sizes"),
    [
        (1, (1,)),
        (3, (1, 2, 3)),
        (8, (1, 2, 4, 8)),
        (10, (1, 2, 4, 8, 10)),
        (32, (1, 2, 4, 8, 16, 24, 32)),
        (36, (1, 2, 4, 8, 16, 24, 32, 36)),
    ],
)
def test_powers_of_two_to_8_then_every_8_and_the_largest(
    max_batch_size: int, sizes: tuple[int, ...]
) -> None:
    assert graph_batch_sizes(max_batch_size) == sizes


def test_every_batch_up_to_the_largest_has_the_smallest_bucket_that_holds_it() -> None:
    sizes = graph_batch_sizes(160)
    for rows in range(1, 161):
        bucket = bucket_for(rows, sizes)
        assert bucket is not None and bucket >= rows
        assert all(size < rows for size in sizes if size < bucket)
        # Past 8 rows, padding adds at most 7.
        assert bucket - rows <= (bucket // 2 if bucket <= 8 else 7)
    assert bucket_for(161, sizes) is None


def test_nonsense_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        graph_batch_sizes(0)
    with pytest.raises(ValueError, match="at least one row"):
        bucket_for(0, (1, 2))
