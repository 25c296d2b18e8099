"""The native kernels' parallel loops (thread_pool.c): every chunk runs exactly once in every
loop, whatever the number of threads and however they are scheduled, and a result does not depend
on that number. Through the compact GEMV that uses them, and through a C driver that builds the
loops with random sleeps at the protocol's critical points."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from baton.engine.native.build import FLAGS, SOURCES
from baton.engine.native.formats import CompactWeight
from baton.engine.native.library import NativeKernels

T = TypeVar("T")


def _with_threads(threads: int, run: Callable[[], T]) -> T:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the loops use the calling thread's OpenMP thread count
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def test_results_are_the_same_bits_on_any_number_of_threads(native: NativeKernels) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = CompactWeight.from_tensor(torch.randn(1000, 256, generator=generator).bfloat16())
    x = torch.randn(13, 256, generator=generator)
    results = [_with_threads(n, lambda: native.gemv(x, weight, None)) for n in (1, 2, 3, 5)]
    for result in results[1:]:
        assert torch.equal(result, results[0])


@pytest.mark.parametrize("threads", [2, 4])
def test_thousands_of_loops_in_a_row_each_compute_every_output(
    native: NativeKernels, threads: int
) -> None:
    """Loops back to back, of changing sizes (from fewer chunks than threads to many), each
    checked against torch: a chunk skipped, or run with an earlier loop's arguments, would
    leave wrong outputs (each loop's input is new, so a stale output cannot pass)."""
    generator = torch.Generator().manual_seed(threads)
    stored = torch.randn(700, 64, generator=generator).bfloat16()
    sizes = (1, 17, 48, 300, 700)
    weights = {n: CompactWeight.from_tensor(stored[:n]) for n in sizes}

    def run() -> None:
        for step in range(2000):
            out_features = sizes[step % len(sizes)]
            x = torch.randn(1 + step % 3, 64, generator=generator)
            expected = x @ stored[:out_features].float().T
            out = native.gemv(x, weights[out_features], None)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

    _with_threads(threads, run)


def test_loops_from_two_threads_at_once_each_get_their_own_results(
    native: NativeKernels,
) -> None:
    """One caller at a time runs a loop; a second waits for it rather than mixing chunks."""
    generator = torch.Generator().manual_seed(1)
    stored = torch.randn(500, 128, generator=generator).bfloat16()
    weight = CompactWeight.from_tensor(stored)
    failures: list[BaseException] = []

    def caller(seed: int) -> None:
        local = torch.Generator().manual_seed(seed)
        try:
            for _ in range(300):
                x = torch.randn(2, 128, generator=local)
                expected = x @ stored.float().T
                torch.testing.assert_close(native.gemv(x, weight, None), expected)
        except BaseException as error:  # reported by the main thread
            failures.append(error)

    callers = [threading.Thread(target=caller, args=(seed,)) for seed in (2, 3)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    assert not failures, failures[0]


@pytest.fixture(scope="module")
def stress_driver(native: NativeKernels, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """thread_pool_stress.c (beside this file) linked with thread_pool.c built with
    BATON_POOL_STRESS."""
    pool_source = next(source for source in SOURCES if source.name == "thread_pool.c")
    driver = tmp_path_factory.mktemp("pool") / "thread_pool_stress"
    library_only = {"-shared", "-fPIC"}
    subprocess.run(
        [
            os.environ.get("CC") or "cc",
            *(flag for flag in FLAGS if flag not in library_only),
            "-DBATON_POOL_STRESS",
            f"-I{pool_source.parent}",
            "-o",
            str(driver),
            str(Path(__file__).parent / "thread_pool_stress.c"),
            str(pool_source),
        ],
        check=True,
    )
    return driver


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_loops_survive_threads_descheduled_at_every_critical_point(
    stress_driver: Path, threads: int
) -> None:
    """Sleeps where a worker reads the loop, where it checks a range's end and where the caller
    publishes a range made the old protocol run chunks twice (3-4 threads) or hang (2 threads,
    a finished count past the loop's chunks) within ten loops. A loop started inside a chunk
    that waited for the (busy) pool instead of running there hangs too."""
    result = subprocess.run(
        [str(stress_driver), "3000"],
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "ok")
