"""PNG plots of serving benchmark results (matplotlib).

They read only the result dicts `baton.bench.serving` writes to `--output-json`, so saved
results can be re-plotted later. Figures are built with `matplotlib.figure.Figure`, which
renders PNGs through Agg without pyplot, so no GUI backend or global pyplot state is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

LATENCY_CDF_PNG = "latency_cdf.png"
THROUGHPUT_PNG = "throughput_vs_concurrency.png"
LATENCY_VS_CONCURRENCY_PNG = "latency_vs_concurrency.png"
ENGINE_COMPARISON_PNG = "engines_vs_concurrency.png"

# (title, result key holding per-request seconds, whether it is one list per request)
_CDF_PANELS = (
    ("TTFT", "ttfts", False),
    ("TPOT", "tpots", False),
    ("ITL", "itls", True),
    ("E2E latency", "e2els", False),
)


def _samples_ms(result: dict[str, Any], key: str, nested: bool) -> np.ndarray:
    values = result[key]
    if nested:
        values = [value for per_request in values for value in per_request]
    return np.sort(np.asarray(values, dtype=np.float64)) * 1000.0


def _concurrency_axis(axis: Axes, levels: Sequence[int]) -> None:
    # Levels usually grow geometrically (1, 4, 16): a log x axis spaces them evenly.
    axis.set_xscale("log", base=2)
    axis.set_xticks(levels, [str(level) for level in levels])
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3)


def plot_latency_cdfs(
    results: Sequence[dict[str, Any]], labels: Sequence[str], out_dir: Path
) -> Path:
    """One 2x2 figure of TTFT/TPOT/ITL/E2E CDFs, a line per result; returns the PNG path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(11, 8), layout="constrained")
    axes = figure.subplots(2, 2)
    for axis, (title, key, nested) in zip(axes.flat, _CDF_PANELS):
        for result, label in zip(results, labels):
            samples = _samples_ms(result, key, nested)
            if samples.size:
                fraction = np.arange(1, samples.size + 1) / samples.size
                axis.step(samples, fraction, where="post", label=label)
        axis.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        axis.grid(alpha=0.3)
        if axis.has_data():
            axis.legend(fontsize="small")
    path = out_dir / LATENCY_CDF_PNG
    figure.savefig(path, dpi=100)
    return path


def plot_concurrency_sweep(sweep: dict[str, Any], out_dir: Path) -> list[Path]:
    """Output throughput, and mean TTFT/TPOT, against max concurrency; returns the PNG paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = sweep["concurrency_levels"]
    results = sweep["results"]
    figure = Figure(figsize=(6, 4), layout="constrained")
    axis = figure.subplots()
    axis.plot(levels, [result["output_throughput"] for result in results], marker="o")
    axis.set(title="Output throughput", xlabel="max concurrency", ylabel="tokens/s")
    _concurrency_axis(axis, levels)
    throughput_path = out_dir / THROUGHPUT_PNG
    figure.savefig(throughput_path, dpi=100)

    figure = Figure(figsize=(11, 4), layout="constrained")
    axes = figure.subplots(1, 2)
    for axis, metric in zip(axes, ("ttft", "tpot")):
        axis.plot(levels, [result[f"mean_{metric}_ms"] for result in results], marker="o")
        axis.set(title=f"Mean {metric.upper()}", xlabel="max concurrency", ylabel="ms")
        _concurrency_axis(axis, levels)
    latency_path = out_dir / LATENCY_VS_CONCURRENCY_PNG
    figure.savefig(latency_path, dpi=100)
    return [throughput_path, latency_path]


def plot_engine_comparison(runs: Sequence[dict[str, Any]], out_dir: Path) -> Path:
    """`baton.bench.compare` runs: output tok/s, mean TTFT and mean TPOT against max concurrency,
    a line per engine (offline engines appear in the throughput panel only); returns the PNG."""
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [run["max_concurrency"] for run in runs]
    engines = list(dict.fromkeys(engine for run in runs for engine in run["summary"]))
    figure = Figure(figsize=(15, 4), layout="constrained")
    axes = figure.subplots(1, 3)
    panels = (("output_throughput", "Output throughput", "tokens/s"),
              ("mean_ttft_ms", "Mean TTFT", "ms"), ("mean_tpot_ms", "Mean TPOT", "ms"))  # fmt: skip
    for axis, (metric, title, unit) in zip(axes, panels):
        for engine in engines:
            points = [
                (level, run["summary"][engine][metric])
                for level, run in zip(levels, runs)
                if engine in run["summary"] and run["summary"][engine][metric] is not None
            ]
            if points:
                axis.plot(*zip(*points), marker="o", label=engine)
        axis.set(title=title, xlabel="max concurrency", ylabel=unit)
        _concurrency_axis(axis, levels)
        if axis.has_data():
            axis.legend(fontsize="small")
    path = out_dir / ENGINE_COMPARISON_PNG
    figure.savefig(path, dpi=100)
    return path
