"""The batch sizes a decode step is captured at, and the bucket a batch is padded to.

A captured graph replays fixed shapes, so each batch runs in the smallest captured size that
holds it, its extra rows padding (they read and write only a dummy page). SGLang's sizes: every
power of two up to 8, where a padded row costs most relatively, then every 8 up to
`--cuda-graph-max-bs`, so padding never adds more than 7 rows to a large batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

SMALL_BATCH_SIZES = (1, 2, 4, 8)
LARGE_BATCH_STEP = 8


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The sizes captured for decode batches of up to `max_batch_size` rows, ascending; the
    largest is `max_batch_size` itself, so every batch up to it has a bucket."""
    if max_batch_size < 1:
        raise ValueError(f"the largest captured batch must be at least 1, not {max_batch_size}")
    sizes = [size for size in SMALL_BATCH_SIZES if size < max_batch_size]
    last_small = SMALL_BATCH_SIZES[-1]
    sizes += range(last_small + LARGE_BATCH_STEP, max_batch_size, LARGE_BATCH_STEP)
    return (*sizes, max_batch_size)


def bucket_for(rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the ascending `sizes` that holds `rows` rows; None past the largest (such
    a batch runs eagerly)."""
    if rows < 1:
        raise ValueError(f"a decode batch has at least one row, not {rows}")
    index = bisect.bisect_left(sizes, rows)
    return sizes[index] if index < len(sizes) else None
