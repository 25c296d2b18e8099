"""The periodic stats line (vLLM's, `--disable-log-stats` turns it off)."""

from __future__ import annotations

import logging

import pytest
from helpers import SAMPLE_STATS
from msgspec.structs import replace

from baton.cli import build_parser
from baton.config_cli import config_from_args
from baton.scheduler_proc.stats_log import LOG_INTERVAL_S, StatsLog, stats_line

# A scheduler that has done nothing yet.
IDLE = replace(
    SAMPLE_STATS, running_requests=0, waiting_requests=0, paused_requests=0, total_pages=200,
    free_pages=200, cached_pages=0, used_pages=0, prompt_tokens=0, cached_prompt_tokens=0,
    generated_tokens=0,
)  # fmt: skip


def test_the_line_reports_the_interval_since_the_last_one() -> None:
    before = replace(IDLE, prompt_tokens=100, cached_prompt_tokens=20, generated_tokens=50)
    after = replace(
        before,
        prompt_tokens=300,
        cached_prompt_tokens=70,
        generated_tokens=550,
        running_requests=3,
        waiting_requests=1,
        used_pages=50,
    )
    assert stats_line(after, before, 10.0) == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    assert stats_line(IDLE, None, 10.0) is None  # nothing ran, nothing queued: no line
    queued = replace(IDLE, waiting_requests=2)
    assert "Waiting: 2 reqs" in stats_line(queued, IDLE, 10.0)


def test_a_line_at_most_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    current = [replace(IDLE, generated_tokens=10, running_requests=1)]
    log = StatsLog(lambda: current[0], now=0.0)
    with caplog.at_level(logging.INFO, logger="baton.scheduler_proc.stats_log"):
        log.maybe_log(LOG_INTERVAL_S / 2)
        assert not caplog.records  # not yet due
        log.maybe_log(LOG_INTERVAL_S)
        current[0] = replace(current[0], generated_tokens=30)
        log.maybe_log(LOG_INTERVAL_S * 1.5)  # due again only an interval after the last line
        log.maybe_log(LOG_INTERVAL_S * 2)
        current[0] = replace(current[0], running_requests=0)
        log.maybe_log(LOG_INTERVAL_S * 3)  # idle since the last line: quiet
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert "Avg generation throughput: 1.0 tokens/s" in lines[0]
    assert "Avg generation throughput: 2.0 tokens/s" in lines[1]


def test_the_flag_has_vllms_name() -> None:
    assert not config_from_args(build_parser().parse_args(["launch"])).disable_log_stats
    args = build_parser().parse_args(["launch", "--disable-log-stats"])
    assert config_from_args(args).disable_log_stats
