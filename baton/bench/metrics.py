"""Serving benchmark metrics: a pure function from per-request records to vLLM's result fields.

Definitions (as vLLM's `benchmark_serving.py`):
- TTFT: first content chunk's arrival - request start.
- ITL: every gap between consecutive content chunks (all requests pooled).
- TPOT, per request with more than one output token: (E2E - TTFT) / (output_tokens - 1).
- E2E latency (E2EL): `end_s` (the last content chunk's arrival) - request start.
Each is summarised as mean, median, std, p90 and p99 in milliseconds; failed requests count
towards `failed` and `errors` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STATISTICS = ("mean", "median", "std", "p90", "p99")
_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestRecord:
    """What the client observed for one request (times from `time.perf_counter`, seconds)."""

    start_s: float
    prompt_len: int
    chunk_times_s: list[float] = field(default_factory=list)
    end_s: float = 0.0
    output_tokens: int = 0
    success: bool = False
    error: str = ""


def summarize(values_s: Sequence[float]) -> dict[str, float]:
    """mean/median/std/p90/p99 of latencies in seconds, reported in ms (0.0 when empty)."""
    if not values_s:
        return dict.fromkeys(STATISTICS, 0.0)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def compute_metrics(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    """The benchmark's result fields from its request records and wall-clock duration.

    Per-request lists (`input_lens`, `output_lens`, `ttfts`, `tpots`, `e2els` in seconds, and
    `itls` as one list of gaps per request) cover successful requests in record order.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    done = [record for record in records if record.success]
    ttfts = [record.chunk_times_s[0] - record.start_s for record in done]
    e2els = [record.end_s - record.start_s for record in done]
    itls = [np.diff(record.chunk_times_s).tolist() for record in done]
    tpots = [
        (e2el - ttft) / (record.output_tokens - 1)
        for record, ttft, e2el in zip(done, ttfts, e2els)
        if record.output_tokens > 1
    ]
    total_input = sum(record.prompt_len for record in done)
    total_output = sum(record.output_tokens for record in done)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "input_throughput": total_input / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    pooled_itls = [gap for gaps in itls for gap in gaps]
    samples = {"ttft": ttfts, "tpot": tpots, "itl": pooled_itls, "e2el": e2els}
    for metric in LATENCY_METRICS:
        for statistic, value in summarize(samples[metric]).items():
            result[f"{statistic}_{metric}_ms"] = value
    result.update(
        input_lens=[record.prompt_len for record in done],
        output_lens=[record.output_tokens for record in done],
        ttfts=ttfts,
        tpots=tpots,
        itls=itls,
        e2els=e2els,
        errors=[record.error for record in records if not record.success],
    )
    return result


def format_report(result: dict[str, Any]) -> str:
    """The human-readable summary, laid out like vLLM's."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Input token throughput (tok/s):", result["input_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for metric in LATENCY_METRICS:
        lines.append("{s:{c}^50}".format(s=_TITLES[metric], c="-"))
        name = metric.upper()
        row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"])
        row(f"Median {name} (ms):", result[f"median_{metric}_ms"])
        row(f"P90 {name} (ms):", result[f"p90_{metric}_ms"])
        row(f"P99 {name} (ms):", result[f"p99_{metric}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)
