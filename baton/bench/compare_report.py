"""`baton.bench.compare`'s report: each engine's headline figures per level, Baton's ratios to
each peer, and the printed tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EngineSummary:
    """One engine's headline figures; latencies are None where the engine has none (offline)."""

    engine: str
    output_throughput: float
    mean_ttft_ms: float | None
    mean_tpot_ms: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def engine_summary(engine: str, result: dict[str, Any]) -> EngineSummary:
    """The summary of a serving result, or of an offline one (which has no TTFT or TPOT)."""
    return EngineSummary(
        engine, result["output_throughput"], result.get("mean_ttft_ms"), result.get("mean_tpot_ms")
    )


def ratios_to_reference(
    summaries: list[EngineSummary], reference: str
) -> dict[str, dict[str, float | None]]:
    """{peer: {metric: reference's value / peer's}}: None where either side lacks the metric
    (or it is zero). Empty without the reference engine."""
    by_engine = {summary.engine: summary for summary in summaries}
    if reference not in by_engine:
        return {}
    ours = by_engine[reference]
    ratios = {}
    for peer in summaries:
        if peer.engine == reference:
            continue
        ratios[peer.engine] = {}
        for metric in METRICS:
            mine, theirs = getattr(ours, metric), getattr(peer, metric)
            usable = mine is not None and theirs  # None or 0 gives no ratio
            ratios[peer.engine][metric] = mine / theirs if usable else None
    return ratios


def format_table(summaries: list[EngineSummary], ratios: dict[str, dict[str, float | None]]) -> str:
    """One row per engine: its figures, then Baton's divided by them (tok/s: higher is better for
    Baton; TTFT and TPOT: lower is better)."""
    header = ("engine", "out tok/s", "TTFT ms", "TPOT ms", "B/x tok/s", "B/x TTFT", "B/x TPOT")
    lines = ["  ".join(f"{cell:>12}" for cell in header)]
    for summary in summaries:
        row = [summary.engine, *(_cell(getattr(summary, metric), "") for metric in METRICS)]
        engine_ratios = ratios.get(summary.engine, {})
        row += [_cell(engine_ratios.get(metric), "x") for metric in METRICS]
        if summary.mean_ttft_ms is None:
            row.append("offline static batches: no TTFT/TPOT")
        lines.append("  ".join(f"{cell:>12}" for cell in row))
    lines.append("B/x = Baton's figure / this engine's (tok/s: >1 Baton faster; TTFT, TPOT: <1)")
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
