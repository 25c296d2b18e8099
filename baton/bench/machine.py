"""The machine a benchmark ran on, recorded beside its figures: figures differ by up to 2.5x
between the CPUs of this workplace, so a figure without its machine means little."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import msgspec
import torch

from baton.engine.cpu.capabilities import detect_cpu_capabilities
from baton.hardware import CpuCapabilities

COPY_BYTES = 256 << 20  # far beyond any L3 here (32 MiB): the copy streams through DRAM


def copy_bandwidth_gb_per_s(repeats: int = 5) -> float:
    """Best-of-`repeats` DRAM bandwidth of one `Tensor.copy_` on every core, in GB/s of bytes
    moved (each byte read once and written once)."""
    source = torch.ones(COPY_BYTES // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * COPY_BYTES / best / 1e9


def describe_machine() -> dict[str, Any]:
    """CPU (model, ISA, cores, what oneDNN packs), memory size and bandwidth, software."""
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "cpu": msgspec.to_builtins(detect_cpu_capabilities()),
        "memory_gib": round(pages / 2**30, 1),
        "copy_gb_per_s": round(copy_bandwidth_gb_per_s(), 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def machine_line(machine: dict[str, Any]) -> str:
    """One line naming the machine (as `describe_machine` gave it), for the top of a report."""
    cpu = msgspec.convert(machine["cpu"], CpuCapabilities)
    return (
        f"Machine: {cpu.summary()}; {machine['memory_gib']} GiB, "
        f"copy {machine['copy_gb_per_s']} GB/s, torch {machine['torch']}"
    )
