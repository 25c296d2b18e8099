"""The speculative-decoding benchmark's figures: /metrics counters, the cells' table and the
issue's check (`baton.bench.speculative` runs the servers)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cell:
    """One workload at one concurrency; `index` is the level's place (its seed offset)."""

    workload: str
    max_concurrency: int
    index: int


SPEC_COUNTERS = {
    "baton:spec_decode_num_drafts_total": "drafts",
    "baton:spec_decode_num_draft_tokens_total": "draft_tokens",
    "baton:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
# A sample line of the exposition format: name, optional {labels}, value (and maybe a timestamp).
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")
# The figures each side of a cell keeps from its serving result.
CELL_METRICS = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "completed", "failed")
ISSUE_TARGET_SPEEDUP = 1.5  # issue 15: single stream on repetitive text


def parse_spec_counters(text: str) -> dict[str, float]:
    """The speculative-decoding counters in /metrics exposition `text` (summed over labels;
    absent ones are 0), under the keys of `SPEC_COUNTERS`."""
    counters = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in SPEC_COUNTERS:
            counters[SPEC_COUNTERS[match.group(1)]] += float(match.group(2))
    return counters


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter grew by between two scrapes."""
    return {key: after[key] - before.get(key, 0.0) for key in after}


def fetch_spec_counters(base_url: str) -> dict[str, float]:
    """The server's speculative-decoding counters, from GET /metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        return parse_spec_counters(response.read().decode("utf-8"))


def acceptance(counters: dict[str, float]) -> dict[str, float | None]:
    """Acceptance rate (accepted / draft tokens) and accepted tokens per speculative step
    (accepted / drafts) of a cell's counter deltas; None where nothing was drafted."""
    drafts, drafted, accepted = (
        counters["drafts"],
        counters["draft_tokens"],
        counters["accepted_tokens"],
    )
    return {
        "acceptance_rate": accepted / drafted if drafted else None,
        "accepted_per_step": accepted / drafts if drafts else None,
    }


def _side(result: dict[str, Any]) -> dict[str, Any]:
    return {key: result[key] for key in CELL_METRICS}


def summarize_cells(
    cell_list: Sequence[Cell], off: Sequence[dict[str, Any]], on: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per cell: off and on figures, the speed-up (on tok/s / off tok/s) and the acceptance of
    the speculative run's counter deltas."""
    rows = []
    for cell, plain, spec in zip(cell_list, off, on, strict=True):
        throughput = plain["output_throughput"]
        rows.append(
            {
                "workload": cell.workload,
                "max_concurrency": cell.max_concurrency,
                "off": _side(plain),
                "on": _side(spec),
                "speedup": spec["output_throughput"] / throughput if throughput else None,
                "spec_counters": spec["spec_counters"],
                **acceptance(spec["spec_counters"]),
            }
        )
    return rows


def _number(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The cells as a markdown table."""
    lines = [
        "| workload | concurrency | tok/s off | tok/s on | speed-up | TPOT off ms | TPOT on ms "
        "| TTFT off ms | TTFT on ms | acceptance | accepted/step |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        off, on = row["off"], row["on"]
        rate = row["acceptance_rate"]
        lines.append(
            "| "
            + " | ".join(
                [
                    row["workload"],
                    str(row["max_concurrency"]),
                    _number(off["output_throughput"]),
                    _number(on["output_throughput"]),
                    _number(row["speedup"], 2, "x"),
                    _number(off["median_tpot_ms"]),
                    _number(on["median_tpot_ms"]),
                    _number(off["median_ttft_ms"]),
                    _number(on["median_ttft_ms"]),
                    "n/a" if rate is None else f"{rate:.0%}",
                    _number(row["accepted_per_step"], 2),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def target_line(rows: Sequence[dict[str, Any]]) -> str | None:
    """The issue's check: single-stream speed-up on repetitive text, against 1.5x."""
    for row in rows:
        if row["workload"] == "repetitive" and row["max_concurrency"] == 1:
            speedup = row["speedup"]
            verdict = (
                "met" if speedup is not None and speedup >= ISSUE_TARGET_SPEEDUP else "not met"
            )
            return (
                f"Single-stream speed-up on repetitive text: {_number(speedup, 2, 'x')} "
                f"(issue 15 expects >= {ISSUE_TARGET_SPEEDUP}x: {verdict})"
            )
    return None
