"""Decode steps timed at start-up, for choices that depend on this machine's speed.

Where bf16 GEMMs run in hardware (AVX512_BF16, AMX: `ComputePlan.gemm_dtype`), how many rows a
decode batch may have and still be faster from the compact weights than from the hardware's
bf16 GEMM depends on the machine and on the model's shapes: the engine measures it once
(`compact_crossover`). The speculative decoder measures what a step costs per row the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

# Batch sizes at which the compact weights and the GEMMs are compared, smallest first.
CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32)
# The GEMMs take over only where they are this much faster: two best-of-three timings of paths
# bound by the same bytes (one row) differ by noise, and the native step's batches are the ones
# measured to be served well elsewhere.
GEMM_WIN_MARGIN = 0.9
# Start-up time the comparison may take: a model of several GB steps in seconds at 32 rows. A
# size is timed only if twice the last size's time still fits (rows double, and so, at worst, does
# the time); out of time, the sizes compared so far decide (larger batches keep the bf16 GEMMs).
CROSSOVER_BUDGET_S = 10.0


def best_time(run_rows: Callable[[int], None], rows: int) -> float:
    """Seconds of `run_rows(rows)`: the best of three, after a warm-up."""
    run_rows(rows)
    times = []
    for _ in range(3):
        started = time.perf_counter()
        run_rows(rows)
        times.append(time.perf_counter() - started)
    return min(times)


class CompactRowsLimit(Protocol):
    """A model whose linear layers read their compact weights in batches of up to a limit."""

    def limit_compact_rows(self, rows: int) -> None: ...


def compact_crossover(
    run_step: Callable[[int], None], model: CompactRowsLimit, largest: int
) -> int:
    """The most rows up to which a decode step from the compact weights (the native step, where
    it serves) was not clearly slower (GEMM_WIN_MARGIN) than the same step through the GEMMs at
    every size of CROSSOVER_ROWS timed; 0 if it lost at one row. `run_step(rows)` runs one idle
    decode step of that many rows. Sizes past the largest batch the server can run, `largest`,
    are not timed: winning up to there, the compact weights keep every batch. Leaves the model's
    compact rows limited to the crossover."""
    crossover, last_size_s = 0, 0.0
    started = time.perf_counter()
    for rows in CROSSOVER_ROWS:
        if rows > largest:
            crossover = largest  # every batch this server can run was won or is smaller
            break
        size_started = time.perf_counter()
        if size_started - started + 2 * last_size_s > CROSSOVER_BUDGET_S:
            break
        model.limit_compact_rows(rows)
        compact = best_time(run_step, rows)
        model.limit_compact_rows(0)
        gemm = best_time(run_step, rows)
        if gemm < compact * GEMM_WIN_MARGIN:
            break
        crossover, last_size_s = rows, time.perf_counter() - size_started
    model.limit_compact_rows(crossover)
    return crossover
