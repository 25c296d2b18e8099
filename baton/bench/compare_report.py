"""`baton.bench.compare`'s report: each engine's headline figures per level (a server's peak
resident memory among them), Baton's ratios to each peer, and the printed tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EngineSummary:
    """One engine's headline figures; latencies and memory are None where the engine has none
    (offline: it runs in this process). `peak_rss_mib`: the peak summed RSS of the server's
    processes while it was measured, in MiB."""

    engine: str
    output_throughput: float
    mean_ttft_ms: float | None
    mean_tpot_ms: float | None
    peak_rss_mib: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")
MEMORY = "peak_rss_mib"


def engine_summary(engine: str, result: dict[str, Any]) -> EngineSummary:
    """The summary of a serving result, or of an offline one (which has no TTFT or TPOT)."""
    return EngineSummary(
        engine,
        result["output_throughput"],
        result.get("mean_ttft_ms"),
        result.get("mean_tpot_ms"),
        result.get(MEMORY),
    )


def ratios_to_reference(
    summaries: list[EngineSummary], reference: str
) -> dict[str, dict[str, float | None]]:
    """{peer: {metric: reference's value / peer's}}: None where either side lacks the metric
    (or it is zero). Memory (`peak_rss_mib`) is among the metrics only where the reference has a
    figure. Empty without the reference engine."""
    by_engine = {summary.engine: summary for summary in summaries}
    if reference not in by_engine:
        return {}
    ours = by_engine[reference]
    metrics = [*METRICS, MEMORY] if ours.peak_rss_mib is not None else METRICS
    ratios = {}
    for peer in summaries:
        if peer.engine == reference:
            continue
        ratios[peer.engine] = {}
        for metric in metrics:
            mine, theirs = getattr(ours, metric), getattr(peer, metric)
            usable = mine is not None and theirs  # None or 0 gives no ratio
            ratios[peer.engine][metric] = mine / theirs if usable else None
    return ratios


def format_table(summaries: list[EngineSummary], ratios: dict[str, dict[str, float | None]]) -> str:
    """One row per engine: its figures, then Baton's divided by them (tok/s: higher is better for
    Baton; TTFT, TPOT and memory: lower is better). The memory columns, "peak RSS MiB" and
    "B/x RSS", appear when some engine has a memory figure."""
    metrics = [*METRICS, MEMORY] if any(s.peak_rss_mib is not None for s in summaries) else METRICS
    header = ["engine", "out tok/s", "TTFT ms", "TPOT ms", "peak RSS MiB"][: 1 + len(metrics)]
    header += ["B/x tok/s", "B/x TTFT", "B/x TPOT", "B/x RSS"][: len(metrics)]
    lines = ["  ".join(f"{cell:>12}" for cell in header)]
    for summary in summaries:
        row = [summary.engine, *(_cell(getattr(summary, metric), "") for metric in metrics)]
        engine_ratios = ratios.get(summary.engine, {})
        row += [_cell(engine_ratios.get(metric), "x") for metric in metrics]
        if summary.mean_ttft_ms is None:
            row.append("offline static batches: no TTFT/TPOT/RSS")
        lines.append("  ".join(f"{cell:>12}" for cell in row))
    legend = "B/x = Baton's figure / this engine's (tok/s: >1 Baton faster; TTFT, TPOT: <1"
    legend += ", RSS: <1 Baton smaller)" if MEMORY in metrics else ")"
    lines.append(legend)
    return "\n".join(lines)


def _cell(value: float | None, suffix: str) -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def level_runs(
    levels: list[int | None], records: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per level: every engine that ran's summary, and Baton's ratios to each peer."""
    runs = []
    for index, level in enumerate(levels):
        summaries = [
            engine_summary(engine, record["results"][index])
            for engine, record in records.items()
            if record["status"] == "ok"
        ]
        runs.append(
            {
                "max_concurrency": level,
                "summary": {summary.engine: summary.to_dict() for summary in summaries},
                "ratios": ratios_to_reference(summaries, "baton"),
            }
        )
    return runs


def print_tables(runs: list[dict[str, Any]]) -> None:
    """A table per level."""
    for run in runs:
        summaries = [EngineSummary(**summary) for summary in run["summary"].values()]
        print(f"\nmax concurrency {run['max_concurrency'] or 'unlimited'}")
        print(format_table(summaries, run["ratios"]))
